// Stands in for the component import `gpuvisor:policy/log@2.0.0` when the guest runs
// natively under `node --test`: records the lines for the tests.
export const lines = [];
export function log(level, message) {
  lines.push([level, message]);
}
