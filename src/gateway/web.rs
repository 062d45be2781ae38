//! The web client: static files under `web/`, compiled into the binary and
//! served at `/` and `/web/{file}`. No build step: plain HTML, CSS and
//! JavaScript modules. The page itself needs no token; it asks for one and
//! sends it on every REST call and websocket it makes.

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
    body: include_str!("../../web/index.html"),
};

const ASSETS: &[Asset] = &[
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../../web/app.css"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../../web/app.js"),
    },
    Asset {
        name: "api.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../../web/api.js"),
    },
    Asset {
        name: "connection.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../../web/connection.js"),
    },
    Asset {
        name: "transcript.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../../web/transcript.js"),
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

/// `GET /web/{file}`: its scripts and styles.
pub async fn asset(Path(name): Path<String>, request: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(asset) => serve(asset, &request),
        None => super::rest::error_response(StatusCode::NOT_FOUND, "not_found", "no such file"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every module the page imports is one the server serves.
    #[test]
    fn every_import_is_served() {
        for asset in ASSETS.iter().chain(std::iter::once(&INDEX)) {
            for (i, _) in asset.body.match_indices("from './") {
                let rest = &asset.body[i + "from './".len()..];
                let name = rest.split('\'').next().unwrap_or("");
                assert!(
                    ASSETS.iter().any(|a| a.name == name),
                    "{} imports {name}, which is not in ASSETS",
                    asset.name
                );
            }
        }
        for reference in ["web/app.css", "web/app.js"] {
            assert!(
                INDEX.body.contains(reference),
                "index.html lacks {reference}"
            );
        }
    }
}
