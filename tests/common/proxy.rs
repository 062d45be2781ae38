//! A TCP proxy in front of a test server that a test can cut: every
//! connection through it is dropped at once, with no websocket close frame,
//! as when a network goes away; new connections are refused until it heals.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
        });
        let shared = inner.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                if shared.blocked.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let task = tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
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
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}
