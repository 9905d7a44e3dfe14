//! Adapters loaded and unloaded while the server serves
//! (`--allow-adapter-loading`): `POST /v1/adapters` with `{"name", "path"}`
//! (an mlx_lm adapter folder on the server's machine), `DELETE
//! /v1/adapters/{name}`. A loaded adapter is served as
//! `"{model_id}:{name}"` from then on; one that requests running or
//! waiting use is not unloaded (409). Off unless the flag says so: the
//! route reads folders of the server's machine.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use mlx_engine::EngineError;
use serde::Deserialize;

use crate::chat::parse;
use crate::wire::ModelCard;
use crate::{ApiError, AppState};

/// `POST /v1/adapters`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LoadAdapter {
    name: String,
    path: std::path::PathBuf,
}

/// Loads the adapter; answers its model card.
pub(crate) async fn load(
    State(state): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<Json<ModelCard>, ApiError> {
    allowed(&state)?;
    let request: LoadAdapter = parse(&body)?;
    let name = request.name.clone();
    state
        .engine
        .load_adapter_async(request.name, request.path)
        .await
        .map_err(|e| refused(&e))?;
    state.add_adapter(&name);
    tracing::info!(adapter = %name, "adapter loaded");
    Ok(Json(state.card(format!("{}:{name}", state.model_id))))
}

/// Unloads the adapter `name`.
pub(crate) async fn unload(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    allowed(&state)?;
    // Not offered from now on, so that no new request takes it while the
    // engine unloads it; offered again if the engine refuses.
    let offered = state.remove_adapter(&name);
    match state.engine.unload_adapter_async(name.clone()).await {
        Ok(()) => {
            tracing::info!(adapter = %name, "adapter unloaded");
            let id = format!("{}:{name}", state.model_id);
            Ok(Json(
                serde_json::json!({"id": id, "object": "model", "deleted": true}),
            ))
        }
        Err(e) => {
            if offered {
                state.add_adapter(&name);
            }
            Err(refused(&e))
        }
    }
}

fn allowed(state: &AppState) -> Result<(), ApiError> {
    match state.adapter_loading {
        true => Ok(()),
        false => Err(ApiError {
            status: StatusCode::FORBIDDEN,
            message: "loading and unloading adapters is off; start the server with --allow-adapter-loading".into(),
            kind: "permission_error",
            param: None,
            code: Some("adapter_loading_off"),
            retry_after: None,
        }),
    }
}

/// An engine's refusal as the client reads it: a name it does not serve
/// (404), one in use (409), an adapter that does not fit or a bad name
/// (400).
fn refused(e: &EngineError) -> ApiError {
    let (status, param, code) = match e {
        EngineError::UnknownAdapter(_) => (StatusCode::NOT_FOUND, "name", "adapter_not_found"),
        EngineError::AdapterInUse { .. } => (StatusCode::CONFLICT, "name", "adapter_in_use"),
        EngineError::AdapterLoad(_) => (StatusCode::BAD_REQUEST, "path", "adapter_invalid"),
        EngineError::InvalidRequest(_) => (StatusCode::BAD_REQUEST, "name", "invalid_name"),
        _ => return ApiError::from_engine(e),
    };
    ApiError {
        status,
        message: e.to_string(),
        kind: "invalid_request_error",
        param: Some(param.to_owned()),
        code: Some(code),
        retry_after: None,
    }
}
