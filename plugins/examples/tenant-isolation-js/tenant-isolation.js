// `tenant-isolation`, the docs/plugins.md tutorial's site placement rule, in JavaScript:
// a gpuvisor ABI v2 component of the world `placement-plugin` (sdk/wit/policy.wit), built
// with componentize-js (scripts/build-plugins; see README.md in this directory).
//
// Rule: instances of different tenants never share a GPU. The tenant is the value of one
// label (`params.tenant_label`, default "tenant"); an instance without that label counts as
// its own tenant, "no tenant". A GPU is usable when every claimed device on it belongs to
// the requesting tenant. GPUs listed in `params.reserved_gpus` (PF addresses) are never
// used, e.g. to keep GPU 0 free for passthrough.
//
// Order: GPUs already running this tenant's vGPUs first (so tenants stay packed and other
// GPUs stay empty for other tenants), then empty GPUs, then by PF address; within a GPU,
// free devices before dirty ones, then by address.
//
// The same answers, reject reasons and params errors as the Rust reference
// (plugins/examples/tenant-isolation/src/lib.rs). The component model's JS mapping:
// records are objects with camelCase fields, enums kebab-case strings, `option` a value or
// undefined, `list<tuple<string, string>>` arrays of [key, value], a variant
// `{tag, val}`; a thrown value of a `result<_, string>` function is its `err`.

import { log } from 'gpuvisor:policy/log@2.0.0';

/** The label that names the tenant when `params.tenant_label` is absent. */
export const DEFAULT_TENANT_LABEL = 'tenant';

/** `manifest: func() -> manifest`. */
export function manifest() {
  return { name: 'tenant-isolation-js', version: '0.1.0', kinds: ['placement'], abiVersion: 2 };
}

/** The `gpuvisor:policy/placement` interface. */
export const placement = {
  /** Ranks the devices the request may use, best first; throws (= `err`) on bad params. */
  place(input) {
    const p = params(input.params);
    const tenant = tenantOf(input.request.labels, p.tenantLabel);

    // [0 = already hosts this tenant | 1 = empty, the GPU], for the GPUs we may use.
    const usable = [];
    for (const gpu of input.inventory.gpus) {
      if (p.reservedGpus.includes(asciiLower(gpu.address))) continue;
      const owners = gpu.devices
        .filter((d) => d.state === 'claimed')
        .map((d) => {
          if (d.owner == null) return null;
          // An owner whose labels cannot be read may be another tenant.
          if (!d.owner.labelsKnown) return '(unknown owner)';
          return tenantOf(d.owner.labels, p.tenantLabel);
        });
      if (owners.some((o) => o !== tenant)) continue; // another tenant runs here
      usable.push([owners.length === 0 ? 1 : 0, gpu]);
    }
    // Array.prototype.sort is stable, like Rust's sort_by.
    usable.sort((a, b) => a[0] - b[0] || compareStr(a[1].address, b[1].address));

    const ranked = usable.flatMap(([, gpu]) => candidates(gpu, input.request.profile));
    if (ranked.length === 0) {
      const who = tenant ?? 'no tenant';
      const profile = input.request.profile;
      if (usable.length === 0) {
        log('info', `no GPU free of other tenants for ${who}`);
        return { tag: 'reject', val: `no GPU without other tenants can take profile ${profile} for tenant ${who}` };
      }
      // GPUs without other tenants exist, but none of their devices can take the profile.
      const gpus = usable.map(([, gpu]) => gpu.address).join(', ');
      log('info', `no device of ${gpus} can take ${profile} for ${who}`);
      return {
        tag: 'reject',
        val:
          `the GPUs without other tenants (${gpus}) have no device that can take profile ${profile} now ` +
          `(in use, or running vGPUs of another size: a GPU runs one vGPU size at a time) for tenant ${who}`,
      };
    }
    return { tag: 'ranked', val: ranked };
  },
};

/** The site parameters from the params JSON object text. */
export function params(text) {
  let v;
  try {
    v = parseJson(text);
  } catch (e) {
    throw `params is not JSON: ${e.message ?? e}`;
  }
  // As serde_json's Value::get on a non-object: every key absent.
  const obj = v instanceof Map ? v : new Map();
  let tenantLabel = DEFAULT_TENANT_LABEL;
  if (obj.has('tenant_label')) {
    const t = obj.get('tenant_label');
    if (typeof t === 'string' && t !== '') tenantLabel = t;
    else throw `params.tenant_label must be a non-empty string, found ${jsonText(t)}`;
  }
  let reservedGpus = [];
  if (obj.has('reserved_gpus')) {
    const r = obj.get('reserved_gpus');
    if (!Array.isArray(r)) throw `params.reserved_gpus must be a list of PF addresses, found ${jsonText(r)}`;
    reservedGpus = r.map((g) => {
      if (typeof g !== 'string') throw `params.reserved_gpus: ${jsonText(g)} is not a string`;
      return asciiLower(g);
    });
  }
  return { tenantLabel, reservedGpus };
}

/** The value of label `key` (labels are sorted [key, value] pairs), null when absent. */
function tenantOf(labels, key) {
  for (const [k, value] of labels) if (k === key) return value;
  return null;
}

/** Free devices that list the profile, then dirty ones (the agent decides whether a dirty
 * VF can take the profile once repaired), each by address. */
function candidates(gpu, profile) {
  return gpu.devices
    .filter(
      (d) =>
        (d.state === 'free' && d.creatable.some((c) => profileMatches(profile, c))) || d.state === 'dirty',
    )
    .map((d) => [d.state === 'dirty' ? 1 : 0, asciiLower(d.address), d.address])
    .sort((a, b) => a[0] - b[0] || compareStr(a[1], b[1]))
    .map((d) => d[2]);
}

// --- The SDK's helpers and Rust's string functions, exactly ------------------------------

const SURROGATE = /[\ud800-\udfff]/;

/** Rust's `str` order (UTF-8 bytes, i.e. code points; JS `<` compares UTF-16 units). */
export function compareStr(a, b) {
  if (a === b) return 0;
  // Without surrogates, UTF-16 unit order is code point order.
  if (!SURROGATE.test(a) && !SURROGATE.test(b)) return a < b ? -1 : 1;
  const x = Array.from(a, (c) => c.codePointAt(0));
  const y = Array.from(b, (c) => c.codePointAt(0));
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

/** Rust's `str::to_ascii_lowercase`: only A-Z change. */
export function asciiLower(s) {
  return s.replace(/[A-Z]+/g, (m) => m.toLowerCase());
}

// Rust's char::is_whitespace (Unicode White_Space), which `str::split_whitespace` uses.
const WHITE_SPACE = /[\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+/u;

/** The SDK's `canonical_profile`: the last whitespace-separated word ("" when none). */
export function canonicalProfile(name) {
  const words = name.split(WHITE_SPACE).filter((w) => w !== '');
  return words.length ? words[words.length - 1] : '';
}

/** The SDK's `profile_matches`: canonical forms equal, ASCII case-insensitively. */
export function profileMatches(requested, name) {
  return asciiLower(canonicalProfile(requested)) === asciiLower(canonicalProfile(name));
}

// --- JSON as serde_json reads and displays it ---------------------------------------------
//
// JSON.parse forgets whether a number was written `7` or `7.0`, which serde_json's Display
// (in the Rust rule's messages) keeps, and JS objects put integer-like keys first. So: a
// small parser where objects are Maps and numbers `JsonNumber`s, and a writer with
// serde_json's output (compact, keys sorted, integers outside i64/u64 as floats, floats in
// shortest form with `.0`, exponents `e+16` / `e-6` outside 1e-5 ..= 1e16).

/** A JSON number: `int` (a BigInt, when it fits i64/u64 as in serde_json) or `float`. */
export class JsonNumber {
  constructor(lexeme) {
    // serde_json reads `-0` as the float -0.0.
    if (!/[.eE]/.test(lexeme) && lexeme !== '-0') {
      const n = BigInt(lexeme);
      if (n >= -(2n ** 63n) && n < 2n ** 64n) {
        this.int = n;
        return;
      }
    }
    this.float = Number(lexeme);
    if (!Number.isFinite(this.float)) throw new SyntaxError(`number out of range: ${lexeme}`);
  }
}

/** Parses JSON text (RFC 8259) into null/booleans/strings/JsonNumber/arrays/Maps. */
export function parseJson(text) {
  let i = 0;
  const ws = () => {
    while (i < text.length && ' \t\n\r'.includes(text[i])) i++;
  };
  const fail = (what) => {
    throw new SyntaxError(`${what} at offset ${i}`);
  };
  const value = () => {
    ws();
    const c = text[i];
    if (c === '{') {
      i++;
      const m = new Map();
      ws();
      if (text[i] === '}') {
        i++;
        return m;
      }
      for (;;) {
        ws();
        if (text[i] !== '"') fail('expected a key');
        const k = string();
        ws();
        if (text[i++] !== ':') fail("expected ':'");
        m.set(k, value());
        ws();
        const d = text[i++];
        if (d === '}') return m;
        if (d !== ',') fail("expected ',' or '}'");
      }
    }
    if (c === '[') {
      i++;
      const a = [];
      ws();
      if (text[i] === ']') {
        i++;
        return a;
      }
      for (;;) {
        a.push(value());
        ws();
        const d = text[i++];
        if (d === ']') return a;
        if (d !== ',') fail("expected ',' or ']'");
      }
    }
    if (c === '"') return string();
    for (const [word, v] of [['true', true], ['false', false], ['null', null]]) {
      if (text.startsWith(word, i)) {
        i += word.length;
        return v;
      }
    }
    const m = /^-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/.exec(text.slice(i));
    if (!m) fail('expected a value');
    i += m[0].length;
    return new JsonNumber(m[0]);
  };
  const string = () => {
    const m = /^"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/.exec(text.slice(i));
    if (!m) fail('bad string');
    i += m[0].length;
    return JSON.parse(m[0]);
  };
  const v = value();
  ws();
  if (i !== text.length) fail('trailing characters');
  return v;
}

/** A parsed JSON value as serde_json's `Display` writes it. */
export function jsonText(v) {
  if (v === null) return 'null';
  if (v === true) return 'true';
  if (v === false) return 'false';
  if (typeof v === 'string') return JSON.stringify(v);
  if (v instanceof JsonNumber) return v.int !== undefined ? v.int.toString() : floatText(v.float);
  if (Array.isArray(v)) return `[${v.map(jsonText).join(',')}]`;
  if (v instanceof Map) {
    const keys = [...v.keys()].sort(compareStr);
    return `{${keys.map((k) => `${JSON.stringify(k)}:${jsonText(v.get(k))}`).join(',')}}`;
  }
  throw new TypeError(`not a parsed JSON value: ${v}`);
}

function floatText(x) {
  const neg = x < 0 || Object.is(x, -0) ? '-' : '';
  if (x === 0) return `${neg}0.0`;
  // toExponential(): the shortest digits that round-trip, as zmij/ryu (serde_json) choose.
  const [mant, exp] = Math.abs(x).toExponential().split('e');
  const digits = mant.replace('.', '');
  const e10 = Number(exp); // x = d.ddd * 10**e10
  if (e10 >= -5 && e10 <= 15) {
    if (e10 >= digits.length - 1) return `${neg}${digits}${'0'.repeat(e10 - digits.length + 1)}.0`;
    if (e10 >= 0) return `${neg}${digits.slice(0, e10 + 1)}.${digits.slice(e10 + 1)}`;
    return `${neg}0.${'0'.repeat(-e10 - 1)}${digits}`;
  }
  return `${neg}${mant}e${e10 >= 0 ? '+' : '-'}${Math.abs(e10)}`;
}
