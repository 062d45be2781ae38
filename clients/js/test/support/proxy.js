// A TCP proxy in front of linger that the test can cut: cut() destroys
// every connection at once (the client sees its socket die mid-turn) and
// answers new ones 503 until heal(); holdDownstream() lets the client's frames
// through but drops everything the server sends, so a reply (an ack, a
// tool call) is lost on the way.

import net from 'node:net';

export async function startProxy(target) {
  const [host, port] = splitAddr(target);
  const pairs = new Set();
  let down = false;
  let holding = false;
  const accepted = new Set();
  const server = net.createServer((client) => {
    accepted.add(client);
    client.on('close', () => accepted.delete(client));
    if (down) {
      // What a load balancer says when nothing is behind it.
      client.end('HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n');
      return;
    }
    const upstream = net.connect(port, host);
    const pair = { client, upstream };
    pairs.add(pair);
    const end = () => {
      pairs.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on('data', (chunk) => upstream.write(chunk));
    upstream.on('data', (chunk) => {
      if (!holding) client.write(chunk);
    });
    client.on('close', end);
    upstream.on('close', end);
    client.on('error', end);
    upstream.on('error', end);
  });
  await new Promise((done) => server.listen(0, '127.0.0.1', done));
  const { port: own } = server.address();
  return {
    url: `http://127.0.0.1:${own}/`,
    get connections() {
      return pairs.size;
    },
    holdDownstream() {
      holding = true;
    },
    cut() {
      down = true;
      holding = false;
      for (const { client, upstream } of pairs) {
        client.destroy();
        upstream.destroy();
      }
      pairs.clear();
    },
    heal() {
      down = false;
    },
    async stop() {
      this.cut();
      for (const socket of accepted) socket.destroy();
      await new Promise((done) => server.close(done));
    },
  };
}

function splitAddr(addr) {
  const i = addr.lastIndexOf(':');
  return [addr.slice(0, i).replace(/^\[|\]$/g, ''), Number(addr.slice(i + 1))];
}
