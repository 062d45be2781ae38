//! A TCP proxy in front of a test server that a test can cut: every
//! connection through it is dropped at once, with no websocket close frame,
//! as when a network goes away; new connections are refused until it heals.
//! It counts the bytes the server sends through it, for tests that check
//! how much a client was sent.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

pub struct Proxy {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    accept: AbortHandle,
}

struct Inner {
    open: Mutex<Vec<AbortHandle>>,
    blocked: AtomicBool,
    /// Bytes from the server to clients, over every connection so far.
    downstream: AtomicU64,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let inner = Arc::new(Inner {
            open: Mutex::new(Vec::new()),
            blocked: AtomicBool::new(false),
            downstream: AtomicU64::new(0),
        });
        let shared = inner.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if shared.blocked.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let counted = shared.clone();
                let task = tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    forward(inbound, outbound, &counted.downstream).await;
                });
                let mut open = shared.open.lock().unwrap();
                open.retain(|t| !t.is_finished());
                open.push(task.abort_handle());
            }
        })
        .abort_handle();
        Proxy {
            addr,
            inner,
            accept,
        }
    }

    pub fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops every open connection and refuses new ones until [`heal`].
    ///
    /// [`heal`]: Proxy::heal
    pub fn cut(&self) {
        self.inner.blocked.store(true, Ordering::SeqCst);
        for task in self.inner.open.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    pub fn heal(&self) {
        self.inner.blocked.store(false, Ordering::SeqCst);
    }

    /// Bytes the server has sent through the proxy so far (all
    /// connections, HTTP and websocket framing included).
    pub fn downstream_bytes(&self) -> u64 {
        self.inner.downstream.load(Ordering::SeqCst)
    }
}

/// Copies both ways until both sides are done, counting the bytes from the
/// server (`outbound`) as they pass; each side's end is passed on as a
/// shutdown of the other's writes.
async fn forward(inbound: TcpStream, outbound: TcpStream, downstream: &AtomicU64) {
    let (mut client_read, mut client_write) = inbound.into_split();
    let (mut server_read, mut server_write) = outbound.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = server_read.read(&mut buf).await {
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
            downstream.fetch_add(n as u64, Ordering::SeqCst);
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(up, down);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}
