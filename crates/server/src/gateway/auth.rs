//! Who is calling: the bearer token (header, or `?token=` because browsers
//! cannot set headers on a websocket) checked against `auth.mode`, before
//! any upgrade.

use axum::extract::{FromRequestParts, Query};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::AppState;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::config::{AuthConfig, AuthMode, TokenEntry};

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    pub user: String,
    pub admin: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("missing token: send `Authorization: Bearer TOKEN` or `?token=TOKEN`")]
    Missing,
    #[error("invalid token")]
    Invalid,
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        super::rest::error_response(StatusCode::UNAUTHORIZED, "unauthorized", &self.to_string())
    }
}

fn token_from(parts: &Parts) -> Option<String> {
    if let Some(value) = parts.headers.get(header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        return value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(|t| t.trim().to_owned());
    }
    url_token(&parts.uri)
}

#[derive(Deserialize)]
struct TokenQuery {
    token: Option<String>,
}

fn url_token(uri: &axum::http::Uri) -> Option<String> {
    Query::<TokenQuery>::try_from_uri(uri).ok()?.0.token
}

/// A user name a dev token or a JWT `sub` may carry: the length every user
/// name has ([`crate::protocol::check_user_name`]), in a narrow character
/// set.
fn valid_user_name(name: &str) -> bool {
    crate::protocol::check_user_name(name).is_ok()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '@'))
}

/// Checks tokens under the configured `auth.mode`; built once at start-up.
pub enum Authenticator {
    /// The token is the user name (loopback only, enforced by the config).
    Dev,
    /// A fixed list from `auth.tokens`.
    Tokens(Vec<TokenEntry>),
    /// HS256 JWTs: user from `sub`, `exp` and `nbf` checked, `admin` claim.
    Jwt(Box<JwtCheck>),
}

pub struct JwtCheck {
    key: DecodingKey,
    validation: Validation,
}

#[derive(Debug, Deserialize)]
struct Claims {
    sub: String,
    #[serde(default)]
    admin: bool,
}

impl Authenticator {
    pub fn from_config(auth: &AuthConfig) -> Result<Authenticator, String> {
        match auth.mode {
            AuthMode::Dev => Ok(Authenticator::Dev),
            AuthMode::Tokens => Ok(Authenticator::Tokens(auth.tokens.clone())),
            AuthMode::Jwt => {
                let secret = std::env::var(&auth.jwt_secret_env).map_err(|_| {
                    format!(
                        "auth.jwt_secret_env: the environment variable {} (the HS256 secret) is not set",
                        auth.jwt_secret_env
                    )
                })?;
                if secret.len() < 16 {
                    return Err(format!(
                        "auth.jwt_secret_env: the secret in {} is shorter than 16 bytes",
                        auth.jwt_secret_env
                    ));
                }
                let mut validation = Validation::new(Algorithm::HS256);
                validation.validate_exp = true;
                validation.validate_nbf = true;
                validation.leeway = 5;
                validation.set_required_spec_claims(&["exp", "sub"]);
                let key = DecodingKey::from_secret(secret.as_bytes())
                    .map_err(|e| format!("auth.jwt_secret_env: unusable secret: {e}"))?;
                Ok(Authenticator::Jwt(Box::new(JwtCheck { key, validation })))
            }
        }
    }

    /// Checks one token.
    pub fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        match self {
            Authenticator::Dev => {
                if valid_user_name(token) {
                    Ok(Caller {
                        user: token.to_owned(),
                        admin: false,
                    })
                } else {
                    Err(AuthError::Invalid)
                }
            }
            Authenticator::Tokens(entries) => {
                // Compare with every entry, in constant time each, so the
                // time taken says nothing about which token came close.
                let mut found: Option<&TokenEntry> = None;
                for entry in entries {
                    if bool::from(entry.token.as_bytes().ct_eq(token.as_bytes())) {
                        found = Some(entry);
                    }
                }
                found
                    .map(|e| Caller {
                        user: e.user.clone(),
                        admin: e.admin,
                    })
                    .ok_or(AuthError::Invalid)
            }
            Authenticator::Jwt(check) => {
                let data = jsonwebtoken::decode::<Claims>(token, &check.key, &check.validation)
                    .map_err(|_| AuthError::Invalid)?;
                if !valid_user_name(&data.claims.sub) {
                    return Err(AuthError::Invalid);
                }
                Ok(Caller {
                    user: data.claims.sub,
                    admin: data.claims.admin,
                })
            }
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = AuthError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, AuthError> {
        let token = token_from(parts).ok_or(AuthError::Missing)?;
        state.auth.authenticate(&token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_query_tokens() {
        let uri = |s: &str| s.parse::<axum::http::Uri>().unwrap();
        assert_eq!(
            url_token(&uri("/v1/ws?a=1&token=al%69ce")),
            Some("alice".into())
        );
        assert_eq!(url_token(&uri("/v1/ws?tok=bob")), None);
    }

    #[test]
    fn user_names() {
        assert!(valid_user_name("alice"));
        assert!(!valid_user_name(""));
        assert!(!valid_user_name("a b"));
    }
}
