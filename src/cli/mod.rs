//! The terminal client, in the same binary as the server: `linger new`,
//! `linger ls`, `linger send` and `linger attach`, talking to a running
//! server over REST and the websocket (protocol v1); for admins,
//! `linger ps`, `linger top` and `linger reload` (`admin.rs`).
//!
//! Conversation content goes to stdout; connection news and hints go to
//! stderr, prefixed `[linger]`, so stdout stays the conversation itself.

pub mod admin;
pub mod attach;
pub mod ls;
pub mod new;
pub mod print;
pub mod ps;
pub mod reload;
pub mod send;
pub mod top;

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde::Deserialize;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long one HTTP request or websocket handshake may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Where the server is and who we are, shared by every client command.
#[derive(clap::Args, Debug, Clone)]
pub struct Remote {
    /// The server's base URL.
    #[arg(long, env = "LINGER_URL", default_value = "http://127.0.0.1:7420")]
    pub url: String,
    /// The bearer token (with dev auth, your user name). Default: $USER.
    #[arg(long, env = "LINGER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// A conversation as REST lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct Summary {
    pub id: String,
    #[serde(default)]
    pub title: String,
    pub status: String,
    #[serde(default)]
    pub head_seq: u64,
    #[serde(default)]
    pub created_at: String,
    #[serde(default)]
    pub last_activity_at: String,
}

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// REST and websocket access to one server with one token.
pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(remote: &Remote) -> anyhow::Result<Client> {
        let base = remote.url.trim_end_matches('/').to_owned();
        if base.starts_with("https://") {
            bail!(
                "{base}: https is not supported by this client; reach the server over http \
                 (on the same machine, or through an SSH tunnel)"
            );
        }
        if !base.starts_with("http://") {
            bail!("{base}: --url must start with http://");
        }
        let token = match &remote.token {
            Some(token) if !token.is_empty() => token.clone(),
            _ => std::env::var("USER")
                .ok()
                .filter(|u| !u.is_empty())
                .ok_or_else(|| anyhow!("no token: pass --token or set LINGER_TOKEN"))?,
        };
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .context("building the HTTP client")?;
        Ok(Client { base, token, http })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The websocket URL, with the token in the query string.
    pub fn ws_url(&self) -> String {
        let rest = self.base.strip_prefix("http://").unwrap_or(&self.base);
        format!("ws://{rest}/v1/ws?token={}", percent_encode(&self.token))
    }

    async fn request(&self, request: reqwest::RequestBuilder, what: &str) -> anyhow::Result<Value> {
        Ok(self.request_with_headers(request, what).await?.0)
    }

    /// As `request`, with the response's headers.
    async fn request_with_headers(
        &self,
        request: reqwest::RequestBuilder,
        what: &str,
    ) -> anyhow::Result<(Value, reqwest::header::HeaderMap)> {
        let response = request
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| anyhow!("cannot reach {}: {}", self.base, plain(&e)))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.text().await.unwrap_or_default();
        let value: Value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&body).unwrap_or(Value::String(body))
        };
        if status.is_success() {
            return Ok((value, headers));
        }
        let message = value["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| value.to_string());
        match status.as_u16() {
            401 => {
                bail!("the server refused the token ({message}); pass --token or set LINGER_TOKEN")
            }
            404 => bail!("{what}: not found"),
            _ => bail!("{what}: {status}: {message}"),
        }
    }

    pub async fn list(&self) -> anyhow::Result<Vec<Summary>> {
        let value = self
            .request(self.http.get(self.url("/v1/conversations")), "listing")
            .await?;
        serde_json::from_value(value).context("the server sent an unexpected list")
    }

    pub async fn conversation(&self, id: &str) -> anyhow::Result<Summary> {
        let path = format!("/v1/conversations/{}", percent_encode(id));
        let value = self
            .request(
                self.http.get(self.url(&path)),
                &format!("conversation {id}"),
            )
            .await?;
        serde_json::from_value(value).context("the server sent an unexpected summary")
    }

    pub async fn create(&self, title: Option<&str>) -> anyhow::Result<Summary> {
        let body = match title {
            Some(title) => serde_json::json!({ "title": title }),
            None => serde_json::json!({}),
        };
        let value = self
            .request(
                self.http.post(self.url("/v1/conversations")).json(&body),
                "creating a conversation",
            )
            .await?;
        serde_json::from_value(value).context("the server sent an unexpected summary")
    }

    /// Opens the websocket.
    pub async fn connect(&self) -> anyhow::Result<Ws> {
        let connecting = tokio_tungstenite::connect_async(self.ws_url());
        match tokio::time::timeout(REQUEST_TIMEOUT, connecting).await {
            Err(_) => bail!("no answer from {} in {REQUEST_TIMEOUT:?}", self.base),
            Ok(Ok((ws, _))) => Ok(ws),
            Ok(Err(tungstenite::Error::Http(response))) if response.status() == 401 => {
                Err(anyhow!(Unauthorized))
            }
            Ok(Err(e)) => bail!("cannot open the websocket at {}: {e}", self.base),
        }
    }
}

/// The websocket upgrade was refused with 401: retrying will not help.
#[derive(Debug, thiserror::Error)]
#[error("the server refused the token; pass --token or set LINGER_TOKEN")]
pub struct Unauthorized;

/// reqwest's error, with its causes, on one line.
fn plain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// A random number, for jitter and message ids, without another dependency.
pub fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.finish()
}

/// Exponential backoff with jitter: half the step plus a random half, the
/// step doubling from 500 ms up to 15 s.
pub fn backoff(attempt: u32) -> Duration {
    let step = 500u64.saturating_mul(1 << attempt.min(5)).min(15_000);
    Duration::from_millis(step / 2 + random_u64() % (step / 2 + 1))
}

/// A fresh `client_msg_id`.
pub fn message_id() -> String {
    format!("cli-{:016x}{:08x}", random_u64(), std::process::id())
}

/// Connection news and hints: on stderr, prefixed, apart from the
/// conversation on stdout.
pub fn note(text: impl std::fmt::Display) {
    eprintln!("[linger] {text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding() {
        assert_eq!(percent_encode("alice"), "alice");
        assert_eq!(percent_encode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn backoff_grows_and_stays_bounded() {
        for attempt in 0..40 {
            let step = 500u64 * (1 << attempt.min(5));
            let step = step.min(15_000);
            let d = backoff(attempt).as_millis() as u64;
            assert!(d >= step / 2 && d <= step, "attempt {attempt}: {d} ms");
        }
    }

    #[test]
    fn ws_url_from_base() {
        let remote = Remote {
            url: "http://127.0.0.1:7420/".into(),
            token: Some("a b".into()),
        };
        let client = Client::new(&remote).unwrap();
        assert_eq!(client.ws_url(), "ws://127.0.0.1:7420/v1/ws?token=a%20b");
        let https = Remote {
            url: "https://example.test".into(),
            token: Some("x".into()),
        };
        assert!(Client::new(&https).is_err());
    }
}
