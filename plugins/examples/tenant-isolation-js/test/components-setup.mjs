// Prepares node_modules/.cache/guests/ for test/components.mjs (the log import's stub).
import { copyFileSync, mkdirSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
const dir = fileURLToPath(new URL('../node_modules/.cache/guests/', import.meta.url));
mkdirSync(dir, { recursive: true });
copyFileSync(fileURLToPath(new URL('./log-stub.mjs', import.meta.url)), `${dir}/log.js`);
