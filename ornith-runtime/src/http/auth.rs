//! `--api-key`: every endpoint but `/health` needs the key (`Authorization: Bearer KEY` or
//! `x-api-key: KEY`), compared in constant time; otherwise 401 in the API's error shape.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Response;

use super::{respond, Api, ApiError, St};

/// Whether `given` equals `key`, in a time that depends on the key's length only.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    let mut diff = given.len() ^ key.len();
    for (i, k) in key.iter().enumerate() {
        diff |= usize::from(given.get(i).copied().unwrap_or(!k) ^ k);
    }
    diff == 0
}

/// `--api-key`: lets a request through when it carries the key (`/health` always).
pub(super) async fn require_key(State(st): St, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Some(key) = st.opts.api_key.as_deref() else { return next.run(req).await };
    let path = req.uri().path().to_string();
    let h = req.headers();
    let bearer = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    let given = h.get("x-api-key").and_then(|v| v.to_str().ok()).or(bearer);
    if path == super::paths::HEALTH || given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    let api = Api::of_path(&path);
    let what = if given.is_some() { "a wrong API key" } else { "no API key" };
    let e = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_api_key",
        format!("the request has {what}; send `Authorization: Bearer KEY` or `x-api-key: KEY` (--api-key)"),
    );
    respond(&st, "auth", api, Err(e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_compare_whole() {
        use super::same_key;
        assert!(same_key(b"secret", b"secret"));
        assert!(!same_key(b"secreT", b"secret"));
        assert!(!same_key(b"secret!", b"secret"));
        assert!(!same_key(b"secre", b"secret"));
        assert!(!same_key(b"", b"secret"));
        assert!(!same_key(&[0xff ^ b's'], b"s"), "one byte differs");
    }
}
