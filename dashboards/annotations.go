package dashboards

import (
	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
)

// annotationSpec is one annotation query: each step at which expr returns a
// series becomes an event on every time-series panel.
type annotationSpec struct {
	name, color string
	expr        string
	title, text string
	tagKeys     string // comma-separated labels that become event tags
	needs       Needs
}

func annotations() []annotationSpec {
	return []annotationSpec{
		{
			name: "Force-fails", color: "orange",
			expr:    "sum by (instance, result, trigger) (" + increase(wd("sglang_watchdog_force_fails_total")) + ") > 0",
			title:   "Force-fail: {{result}}",
			text:    "{{instance}}, trigger {{trigger}}",
			tagKeys: "result,trigger",
			needs:   NeedsForceFail,
		},
		{
			name: "Wedged schedulers", color: "red",
			expr:    "max by (instance, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_scheduler_wedged") + ") == 1",
			title:   "Scheduler wedged",
			text:    "{{instance}} dp_rank {{dp_rank}} pp_rank {{pp_rank}}",
			tagKeys: "dp_rank,pp_rank",
			needs:   NeedsPlugin | NeedsWedge,
		},
		{
			name: "Transfer wedges", color: "purple",
			expr:    "max by (instance, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_transfer_wedged") + ") == 1",
			title:   "Transfer queue wedged",
			text:    "{{instance}} dp_rank {{dp_rank}} pp_rank {{pp_rank}}",
			tagKeys: "dp_rank,pp_rank",
			needs:   NeedsPlugin | NeedsTransferWedge,
		},
	}
}

// Annotations returns the dashboard's annotation queries as Query values:
// Panel is the annotation's name, RefID "Anno", Row empty.
func Annotations() []Query {
	var out []Query
	for _, a := range annotations() {
		out = append(out, Query{Panel: a.name, RefID: annotationRefID, Expr: a.expr, Legend: a.title, Needs: a.needs})
	}
	return out
}

const annotationRefID = "Anno"

func annotationBuilder(a annotationSpec) cog.Builder[dashboard.AnnotationQuery] {
	return dashboard.NewAnnotationQueryBuilder().
		Name(a.name).
		Datasource(datasourceRef()).
		Enable(true).
		IconColor(a.color).
		Target(prometheus.NewDataqueryBuilder().
			Datasource(datasourceRef()).
			RefId(annotationRefID).
			Expr(a.expr).
			Range()).
		TitleFormat(a.title).
		TextFormat(a.text).
		TagKeys(a.tagKeys)
}
