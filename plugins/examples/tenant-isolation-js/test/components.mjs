// Optional cross-check of the built components without the gpuvisor host:
// `npm run check-components` transpiles target/plugins/tenant-isolation-{py,js}.wasm with
// `jco transpile` into node_modules/.cache/guests/ (WASI from jco's preview2-shim, the log
// import from test/log-stub.mjs), runs every shared case through them and compares with
// the Rust reference's answers. (Node 20 needs --experimental-wasm-extended-const for the
// Python component; the npm script passes it.) One instance serves all calls here, unlike
// the host, which instantiates afresh per call.
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { lines } from '../node_modules/.cache/guests/log.js';
import { placementFixtures, placementInput } from './v2-view.mjs';

const here = (p) => fileURLToPath(new URL(p, import.meta.url));
const CASES = JSON.parse(readFileSync(here('../../tenant-isolation/tests/cases.json'), 'utf8')).cases;

function caseInput(c) {
  const v1 = structuredClone(placementFixtures().find(([f]) => f === c.fixture)[1]);
  for (const [path, value] of c.set ?? []) {
    const keys = path.split('/').slice(1);
    const last = keys.pop();
    keys.reduce((o, k) => o[k], v1)[last] = value;
  }
  const input = placementInput(v1);
  if (c.params !== undefined) input.params = c.params;
  return input;
}

let bad = 0;
for (const g of ['py', 'js']) {
  const wasm = here(`../../../../target/plugins/tenant-isolation-${g}.wasm`);
  execFileSync(here('../node_modules/.bin/jco'), [
    'transpile', wasm, '-q', '-o', here(`../node_modules/.cache/guests/${g}`),
    '--map', 'gpuvisor:policy/log@2.0.0=../log.js',
  ]);
  const m = await import(`../node_modules/.cache/guests/${g}/tenant-isolation-${g}.js`);
  console.log(`${g}: manifest ${JSON.stringify(m.manifest())}`);
  for (const c of CASES) {
    lines.length = 0;
    let got;
    try {
      const a = m.placement.place(caseInput(c));
      got = { ok: { [a.tag]: a.val } };
    } catch (e) {
      got = e.payload !== undefined ? { error: e.payload } : { thrown: String(e) };
    }
    const same = JSON.stringify(got) === JSON.stringify(c.expect);
    if (!same) bad++;
    console.log(`${g}: ${same ? 'same' : 'DIFFERENT'}: ${c.name}${same ? '' : ` ${JSON.stringify(got)}`}`);
  }
}
process.exit(bad ? 1 : 0);
