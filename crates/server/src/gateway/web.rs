//! The web client: static files under `web/` and the JavaScript client
//! module (`clients/js/src`, as `/web/linger/...`), compiled into the
//! binary and served at `/` and `/web/{*file}`. No build step: plain HTML,
//! CSS and JavaScript modules, imported as they are. The page itself needs
//! no token; it asks for one and sends it on every REST call and websocket
//! it makes.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// One embedded file: its name under `/web/`, content type and bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const INDEX: Asset = Asset {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_str!("../../../../web/index.html"),
};

const JS: &str = "text/javascript; charset=utf-8";

/// The page's files, and under `linger/` the JavaScript client module
/// (`clients/js/src`, the same files that are published), which the page
/// imports as it is.
const ASSETS: &[Asset] = &[
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../../../../web/app.css"),
    },
    Asset {
        name: "app.js",
        content_type: JS,
        body: include_str!("../../../../web/app.js"),
    },
    Asset {
        name: "dom.js",
        content_type: JS,
        body: include_str!("../../../../web/dom.js"),
    },
    Asset {
        name: "admin.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../../../../web/admin.css"),
    },
    Asset {
        name: "admin.js",
        content_type: JS,
        body: include_str!("../../../../web/admin.js"),
    },
    Asset {
        name: "markdown.js",
        content_type: JS,
        body: include_str!("../../../../web/markdown.js"),
    },
    Asset {
        name: "vendor/markdown-it.esm.min.mjs",
        content_type: JS,
        body: include_str!("../../../../web/vendor/markdown-it.esm.min.mjs"),
    },
    Asset {
        name: "linger/index.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/index.js"),
    },
    Asset {
        name: "linger/client.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/client.js"),
    },
    Asset {
        name: "linger/conversation.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/conversation.js"),
    },
    Asset {
        name: "linger/emitter.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/emitter.js"),
    },
    Asset {
        name: "linger/errors.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/errors.js"),
    },
    Asset {
        name: "linger/rest.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/rest.js"),
    },
    Asset {
        name: "linger/socket.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/socket.js"),
    },
    Asset {
        name: "linger/store.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/store.js"),
    },
    Asset {
        name: "linger/transcript.js",
        content_type: JS,
        body: include_str!("../../../../clients/js/src/transcript.js"),
    },
];

/// The page may talk to its own origin only (REST and the websocket).
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
                   img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; \
                   base-uri 'self'; form-action 'none'";

/// One ETag for every file: they change together, with the binary.
static ETAG: LazyLock<String> = LazyLock::new(|| {
    let mut hasher = DefaultHasher::new();
    INDEX.body.hash(&mut hasher);
    for asset in ASSETS {
        asset.name.hash(&mut hasher);
        asset.body.hash(&mut hasher);
    }
    format!("\"{:016x}\"", hasher.finish())
});

fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let etag = ETAG.as_str();
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.content_type),
            )],
            asset.body,
        )
            .into_response()
    };
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(etag) {
        headers.insert(header::ETAG, value);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if asset.content_type.starts_with("text/html") {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        );
        headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    }
    response
}

/// `GET /`: the page.
pub async fn index(request: HeaderMap) -> Response {
    serve(&INDEX, &request)
}

/// `GET /web/{*file}`: its scripts and styles (`file` may hold a `/`).
pub async fn asset(Path(name): Path<String>, request: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(asset) => serve(asset, &request),
        None => super::rest::error_response(StatusCode::NOT_FOUND, "not_found", "no such file"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every module the page imports (relative to the importing file) is
    /// one the server serves.
    #[test]
    fn every_import_is_served() {
        for asset in ASSETS.iter().chain(std::iter::once(&INDEX)) {
            let dir = asset.name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
            for quote in ['\'', '"'] {
                for pattern in [format!("from {quote}./"), format!("import {quote}./")] {
                    for (i, _) in asset.body.match_indices(pattern.as_str()) {
                        let rest = &asset.body[i + pattern.len()..];
                        let file = rest.split(quote).next().unwrap_or("");
                        let name = if dir.is_empty() {
                            file.to_owned()
                        } else {
                            format!("{dir}/{file}")
                        };
                        assert!(
                            ASSETS.iter().any(|a| a.name == name),
                            "{} imports {name}, which is not in ASSETS",
                            asset.name
                        );
                    }
                }
            }
        }
        // Every module of the client is served, so the page can import it.
        // This crate is crates/server; the client is the repository's.
        let client = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/js/src");
        for entry in std::fs::read_dir(&client).expect("read clients/js/src") {
            let file = entry.expect("a directory entry").file_name();
            let name = format!("linger/{}", file.to_string_lossy());
            assert!(
                ASSETS.iter().any(|a| a.name == name),
                "clients/js/src/{} is not served as /web/{name}",
                file.to_string_lossy()
            );
        }
        for reference in ["web/app.css", "web/app.js"] {
            assert!(
                INDEX.body.contains(reference),
                "index.html lacks {reference}"
            );
        }
    }
}
