// tenant-isolation.js natively (`npm test`): the shared cases of the Rust reference
// (plugins/examples/tenant-isolation/tests/cases.json), the manifest, and the helpers that
// must behave like Rust's and serde_json's.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { lines } from './log-stub.mjs';
import { placementFixtures, placementInput } from './v2-view.mjs';
import {
  manifest,
  placement,
  parseJson,
  jsonText,
  canonicalProfile,
  profileMatches,
  asciiLower,
  compareStr,
} from '../tenant-isolation.js';

const CASES = JSON.parse(
  readFileSync(new URL('../../tenant-isolation/tests/cases.json', import.meta.url), 'utf8'),
).cases;

/** The v2 input of a shared case: its fixture, `set` replacements, `params` text. */
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

/** The reply in the v1 shape of `expect`: {ok: answer} or {error: message}. */
function reply(input) {
  try {
    const a = placement.place(input);
    return { ok: { [a.tag]: a.val } };
  } catch (e) {
    assert.equal(typeof e, 'string', `a thrown non-string: ${e}`);
    return { error: e };
  }
}

for (const c of CASES) {
  test(`case: ${c.name}`, () => {
    lines.length = 0;
    assert.deepEqual(reply(caseInput(c)), c.expect);
    const reject = c.expect.ok?.reject;
    const who = reject?.match(/ for tenant (.*)$/)?.[1];
    // GPUs without other tenants, none of whose devices can take it, are named.
    const gpus = reject?.match(/^the GPUs without other tenants \(([^)]*)\)/)?.[1];
    const line = gpus
      ? `no device of ${gpus} can take ${caseInput(c).request.profile} for ${who}`
      : `no GPU free of other tenants for ${who}`;
    assert.deepEqual(lines, reject ? [['info', line]] : []);
  });
}

test('every placement fixture has a shared case', () => {
  for (const [f] of placementFixtures()) {
    assert.ok(CASES.some((c) => c.fixture === f && !c.set && c.params === undefined), f);
  }
});

test('the manifest names the JS port, kind placement, ABI 2', () => {
  assert.deepEqual(manifest(), {
    name: 'tenant-isolation-js',
    version: '0.1.0',
    kinds: ['placement'],
    abiVersion: 2,
  });
});

test('params that are not JSON are an error', () => {
  const input = caseInput(CASES[0]);
  input.params = '{';
  assert.match(reply(input).error, /^params is not JSON: /);
});

test('JSON values are written as serde_json displays them', () => {
  // Left: the text; right: serde_json 1.0.154's `Value` Display of it.
  const cases = [
    ['7', '7'],
    ['7.0', '7.0'],
    ['1e5', '100000.0'],
    ['1e15', '1000000000000000.0'],
    ['1e16', '1e+16'],
    ['1.5e16', '1.5e+16'],
    ['100000000000000000000', '1e+20'],
    ['1e-5', '0.00001'],
    ['1e-6', '1e-6'],
    ['1.5e-7', '1.5e-7'],
    ['-0', '-0.0'],
    ['-0.0', '-0.0'],
    ['123456789012345678', '123456789012345678'],
    ['18446744073709551615', '18446744073709551615'],
    ['18446744073709551616', '1.8446744073709552e+19'],
    ['-9223372036854775809', '-9.223372036854776e+18'],
    ['1e300', '1e+300'],
    ['"\\u0001\\n\\"\\u00e9/"', '"\\u0001\\n\\"é/"'],
    ['{"b": 1, "a": [true, null, {}], "10": [], "9": 0}', '{"10":[],"9":0,"a":[true,null,{}],"b":1}'],
  ];
  for (const [text, shown] of cases) assert.equal(jsonText(parseJson(text)), shown, text);
  for (const bad of ['', '{', '[1,]', '01', '"\u0001"', '1e400', 'nul', '{} x']) {
    assert.throws(() => parseJson(bad), SyntaxError, bad);
  }
});

test('string helpers are those of Rust and the SDK', () => {
  assert.equal(canonicalProfile('NVIDIA L40S-2Q'), 'L40S-2Q');
  assert.equal(canonicalProfile(' \u3000 '), '');
  assert.equal(canonicalProfile('NVIDIA\u00a0L40S-2Q'), 'L40S-2Q'); // NBSP is White_Space
  assert.equal(canonicalProfile('NVIDIA\ufeffL40S-2Q'), 'NVIDIA\ufeffL40S-2Q'); // BOM is not
  assert.ok(profileMatches('l40s-2q', 'NVIDIA L40S-2Q'));
  assert.ok(!profileMatches('L40S-2', 'NVIDIA L40S-2Q'));
  assert.ok(!profileMatches('\u0130', 'i')); // only ASCII folds
  assert.equal(asciiLower('0000:4A:00.0 ÀÉ'), '0000:4a:00.0 ÀÉ');
  assert.ok(compareStr('\uffff', '\u{10000}') < 0); // code points, not UTF-16 units
  assert.ok(compareStr('a', 'ab') < 0 && compareStr('b', 'ab') > 0 && compareStr('x', 'x') === 0);
});
