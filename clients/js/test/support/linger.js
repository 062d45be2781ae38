// A real linger server for the tests: the binary named by LINGER_BIN (the
// Rust test passes target/release/linger), on 127.0.0.1:0 with its store
// in a fresh temporary directory, ready once its log says `listening on`.

import { spawn } from 'node:child_process';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';

const here = fileURLToPath(new URL('.', import.meta.url));
export const LINGER_BIN = process.env.LINGER_BIN || resolve(here, '../../../../target/release/linger');

// How long any single wait may take before the test fails and says what
// it waited for (the shared machine is slow, so this is generous).
export const WAIT_MS = 30_000;

export async function startLinger(extraToml = '') {
  const dir = await mkdtemp(join(tmpdir(), 'linger-js-'));
  const config = join(dir, 'linger.toml');
  await writeFile(
    config,
    `[server]\nlisten = "127.0.0.1:0"\n[store]\npath = ${JSON.stringify(join(dir, 'data'))}\n${extraToml}\n`,
  );
  const child = spawn(LINGER_BIN, ['serve', '--config', config], {
    env: { ...process.env, LINGER_LOG: 'info', NO_COLOR: '1' },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const log = [];
  const exited = new Promise((done) => child.once('exit', (code, signal) => done({ code, signal })));
  const addr = await new Promise((done, fail) => {
    const timer = setTimeout(() => fail(new Error(`linger did not log 'listening on' within ${WAIT_MS} ms:\n${log.join('\n')}`)), WAIT_MS);
    child.once('error', (e) => {
      clearTimeout(timer);
      fail(new Error(`cannot start ${LINGER_BIN}: ${e.message}`));
    });
    exited.then(({ code, signal }) => {
      clearTimeout(timer);
      fail(new Error(`linger exited (${code ?? signal}) before listening:\n${log.join('\n')}`));
    });
    createInterface({ input: child.stderr }).on('line', (line) => {
      log.push(line);
      const m = /listening on (\S+)/.exec(line);
      if (m) {
        clearTimeout(timer);
        done(m[1]);
      }
    });
  });
  return {
    addr,
    url: `http://${addr}/`,
    log,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
      await exited;
      await rm(dir, { recursive: true, force: true });
    },
  };
}
