// `node --import ./test/register.mjs`: resolves the component import
// `gpuvisor:policy/log@2.0.0` to test/log-stub.mjs, so tenant-isolation.js runs natively.
import { register } from 'node:module';

register(
  'data:text/javascript,' +
    encodeURIComponent(`
      export async function resolve(specifier, context, next) {
        if (specifier === 'gpuvisor:policy/log@2.0.0') {
          return { url: new URL('./log-stub.mjs', ${JSON.stringify(import.meta.url)}).href, shortCircuit: true };
        }
        return next(specifier, context);
      }`),
);
