package watchdog

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// The watchdog's own HTTP answers. internal/server mounts them beside the
// metrics, health and webhook routes; they stay methods of the Watchdog so
// that this package's tests serve them without that package.

// VerdictHandler serves GET pluginapi.PathRoomVerdict +
// "<room>?rid=<rid>&age_seconds=<age>": this watchdog's read-only verdict
// on the room of a decode request, for decode-side watchdogs. Without rid
// and age (an older decode-side watchdog) it never answers stopped.
func (w *Watchdog) VerdictHandler() http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			rw.Header().Set("Allow", "GET, HEAD")
			writeJSON(rw, http.StatusMethodNotAllowed, map[string]string{"error": "only GET"})
			return
		}
		room, err := strconv.ParseUint(strings.TrimPrefix(r.URL.Path, pluginapi.PathRoomVerdict), 10, 64)
		if err != nil || !strings.HasPrefix(r.URL.Path, pluginapi.PathRoomVerdict) {
			writeJSON(rw, http.StatusBadRequest, map[string]string{"error": "want " + pluginapi.PathRoomVerdict + "<room>, room a decimal integer below 2^64"})
			return
		}
		q, err := verdictQuery(r.URL.Query(), room)
		if err != nil {
			writeJSON(rw, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		writeJSON(rw, http.StatusOK, w.PrefillVerdict(q))
	})
}

// verdictQuery reads the decode request a lookup names; absent fields
// bind to nothing (rid "" matches no release, age 0 predates every one).
func verdictQuery(params url.Values, room uint64) (pluginapi.VerdictQuery, error) {
	q := pluginapi.VerdictQuery{Room: room, RID: params.Get(pluginapi.VerdictParamRID)}
	if len(q.RID) > pluginapi.MaxVerdictRIDBytes {
		return q, fmt.Errorf("%s exceeds %d bytes", pluginapi.VerdictParamRID, pluginapi.MaxVerdictRIDBytes)
	}
	if s := params.Get(pluginapi.VerdictParamAge); s != "" {
		age, err := strconv.ParseFloat(s, 64)
		if err != nil || math.IsNaN(age) || math.IsInf(age, 0) || age < 0 {
			return q, fmt.Errorf("%s must be a finite number of seconds, not negative", pluginapi.VerdictParamAge)
		}
		q.AgeSeconds = age
	}
	return q, nil
}

// writeJSON answers with status and v. The values always encode, so an
// error here is a client gone mid-answer, which nothing is left to tell.
func writeJSON(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	_ = json.NewEncoder(rw).Encode(v)
}
