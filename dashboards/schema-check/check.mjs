// Checks Grafana dashboard JSON files against Grafana's own schema types
// (@grafana/schema, pinned in package-lock.json) with the TypeScript compiler.
//
//   node check.mjs ../sglang-watchdog.json [more.json ...]
//
// Each dashboard becomes a TypeScript object literal typed with the schema:
// the dashboard as Dashboard, and each panel's options and custom field config
// as the Options and FieldConfig of its panel type. Object literals get
// TypeScript's excess-property check, so an unknown field fails as surely as a
// wrong type or a value outside an enum (the schema's string enums are checked
// as the unions of their values, which is what the JSON holds).
//
// One addition to the schema: an annotation query's target is the data
// source's query (AnnotationQuery<TQuery> in @grafana/schema), so it is typed
// as a Prometheus query here, and titleFormat, textFormat and tagKeys, which
// Grafana's Prometheus data source reads from the annotation itself, are
// allowed next to it. @grafana/schema has no Prometheus query type.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';

const here = path.dirname(fileURLToPath(import.meta.url));

// Panel types, the schema module of their options, and whether it has a
// custom field config (a stat panel has none).
const panelSchemas = {
  timeseries: { mod: 'timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen', custom: true },
  stat: { mod: 'stat/panelcfg/x/StatPanelCfg_types.gen', custom: false },
  heatmap: { mod: 'heatmap/panelcfg/x/HeatmapPanelCfg_types.gen', custom: true },
};

function source(dashboard) {
  const lines = [
    `import type { Dashboard, AnnotationQuery, DataQuery } from '@grafana/schema';`,
    ...Object.entries(panelSchemas).map(
      ([type, { mod }]) => `import type * as ${type} from '@grafana/schema/dist/esm/raw/composable/${mod}';`,
    ),
    // The JSON holds the values of the schema's string enums.
    'type Lit<T> = T extends string ? `${T}` : T extends readonly (infer E)[] ? Lit<E>[] : T extends object ? { [K in keyof T]: Lit<T[K]> } : T;',
    'interface PrometheusQuery extends DataQuery { expr: string; range?: boolean; instant?: boolean; interval?: string; legendFormat?: string; format?: string }',
    'interface PrometheusAnnotation extends AnnotationQuery<PrometheusQuery> { titleFormat?: string; textFormat?: string; tagKeys?: string; useValueForTime?: boolean }',
    "type Checked = Omit<Dashboard, 'annotations'> & { annotations?: { list?: PrometheusAnnotation[] } };",
    `export const dashboard: Lit<Checked> = ${JSON.stringify(dashboard, null, 2)};`,
  ];
  const panels = (dashboard.panels ?? []).flatMap((p) => [p, ...(p.panels ?? [])]);
  for (const p of panels) {
    if (p.type === 'row') continue;
    const where = `// panel ${p.id} ${JSON.stringify(p.title)} (${p.type})`;
    if (!panelSchemas[p.type]) {
      throw new Error(`${where.slice(3)}: no schema module for panel type ${p.type}; add it to panelSchemas`);
    }
    lines.push(where);
    lines.push(`export const options_${p.id}: Lit<${p.type}.Options> = ${JSON.stringify(p.options ?? {}, null, 2)};`);
    lines.push(where);
    const customType = panelSchemas[p.type].custom ? `Lit<${p.type}.FieldConfig>` : 'Record<string, never>';
    lines.push(`export const custom_${p.id}: ${customType} = ${JSON.stringify(p.fieldConfig?.defaults?.custom ?? {}, null, 2)};`);
  }
  return lines.join('\n') + '\n';
}

function check(file) {
  const dashboard = JSON.parse(fs.readFileSync(file, 'utf8'));
  // The generated module sits here so that node_modules resolves.
  const dir = fs.mkdtempSync(path.join(here, '.check-'));
  const tsFile = path.join(dir, 'dashboard.ts');
  try {
    const text = source(dashboard);
    fs.writeFileSync(tsFile, text);
    const program = ts.createProgram([tsFile], {
      strict: true,
      noEmit: true,
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.ESNext,
      moduleResolution: ts.ModuleResolutionKind.Bundler,
      skipLibCheck: true,
      types: [],
    });
    const lines = text.split('\n');
    const errors = ts.getPreEmitDiagnostics(program).map((d) => {
      const msg = ts.flattenDiagnosticMessageText(d.messageText, '\n  ');
      if (!d.file || d.file.fileName !== tsFile) return msg;
      const { line } = d.file.getLineAndCharacterOfPosition(d.start);
      let panel = 'dashboard';
      for (let i = line; i >= 0; i--) {
        if (lines[i].startsWith('// panel ')) { panel = lines[i].slice(3); break; }
      }
      return `${panel}, at ${lines[line].trim()}\n  ${msg}`;
    });
    return errors;
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error('usage: node check.mjs DASHBOARD.json...');
  process.exit(2);
}
let failed = false;
for (const f of files) {
  const errors = check(f);
  if (errors.length > 0) {
    failed = true;
    console.error(`${f}: ${errors.length} schema error(s) against @grafana/schema:`);
    for (const e of errors) console.error(`- ${e}`);
  } else {
    console.log(`${f}: valid against @grafana/schema`);
  }
}
process.exit(failed ? 1 : 0);
