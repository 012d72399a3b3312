// A v1 placement input (the JSON of plugins/fixtures/placement-*.json) as the ABI v2 host
// hands it to a component, in the component model's JS mapping (what componentize-js
// lifts): camelCase fields, kebab-case enum strings, `option` = value or undefined, u64 =
// BigInt, labels = sorted [key, value] pairs, params = JSON object text.
import { readFileSync, readdirSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';

export const FIXTURES = fileURLToPath(new URL('../../../fixtures/', import.meta.url));

/** The placement fixtures: [file name, parsed v1 input]. */
export function placementFixtures() {
  return readdirSync(FIXTURES)
    .filter((f) => f.startsWith('placement-') && f.endsWith('.json'))
    .sort()
    .map((f) => [f, JSON.parse(readFileSync(join(FIXTURES, f), 'utf8'))]);
}

const opt = (v, f = (x) => x) => (v == null ? undefined : f(v));
const kebab = (s) => s.replaceAll('_', '-');
const u64 = (n) => BigInt(n);
// Sorted by key (the v1 labels are a BTreeMap: UTF-8 byte order = code point order).
const labels = (o) =>
  Object.entries(o ?? {}).sort(([a], [b]) => {
    const x = Array.from(a, (c) => c.codePointAt(0));
    const y = Array.from(b, (c) => c.codePointAt(0));
    for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
    return x.length - y.length;
  });

export function placementInput(v1) {
  const r = v1.request;
  return {
    request: {
      instanceId: r.instance_id,
      name: r.name,
      labels: labels(r.labels),
      framework: kebab(r.framework),
      profile: r.profile,
      framebufferMib: opt(r.framebuffer_mib, u64),
    },
    inventory: {
      gpus: v1.inventory.gpus.map((g) => ({
        address: g.address,
        model: g.model,
        framebufferMib: opt(g.framebuffer_mib, u64),
        numaNode: opt(g.numa_node),
        claimedFramebufferMib: u64(g.claimed_framebuffer_mib ?? 0),
        loadKnown: g.load_known ?? true,
        devices: (g.devices ?? []).map((d) => ({
          address: d.address,
          state: d.state,
          currentType: opt(d.current_type),
          creatable: d.creatable ?? [],
          owner: opt(d.owner, (o) => ({
            instanceId: o.instance_id ?? '',
            profile: opt(o.profile),
            labels: labels(o.labels),
            labelsKnown: o.labels_known ?? true,
          })),
        })),
      })),
    },
    params: JSON.stringify(v1.params ?? {}),
  };
}
