//! `POST /v1/chat/completions`: a request checked and turned into an
//! engine [`Completion`], its answer whole or as server-sent events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use mlx_engine::{
    Completion, CompletionStream, Constraint, Finish, FinishReason, Message, Sampling, StreamEvent,
    TokenLogprob,
};

use crate::error::ApiError;
use crate::wire::{
    AssistantMessage, ChatChunk, ChatCompletion, ChatRequest, Choice, ChunkChoice, Content, Delta,
    Logprobs, PromptTokensDetails, Stop, TokenLogprobs, TopLogprob, Usage,
};
use crate::AppState;

/// OpenAI allows at most this many alternatives per token.
const MAX_TOP_LOGPROBS: u32 = 20;

/// What a checked request asks besides its completion.
struct Asked {
    /// The id the request named (the base, or the base with an adapter).
    model: String,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

pub(crate) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // A body too big (or cut off) is an error object like any other.
    let body = body.map_err(|rejection| ApiError {
        status: rejection.status(),
        message: rejection.body_text(),
        kind: "invalid_request_error",
        param: Some("body".into()),
        code: None,
        retry_after: None,
    })?;
    let request: ChatRequest = parse(&body)?;
    let (completion, asked) = check(&state, request)?;
    // Off the async threads: compiling a response schema can take a while.
    let engine = state.engine.clone();
    let stream = tokio::task::spawn_blocking(move || engine.complete(completion))
        .await
        .map_err(|e| ApiError::from_engine(&mlx_engine::EngineError::Panicked(e.to_string())))?
        .map_err(|e| ApiError::from_engine(&e))?;
    let id = format!("chatcmpl-{}", state.next_id());
    let answer = Answer {
        id,
        created: now(),
        model: asked.model.clone(),
    };
    if asked.stream {
        Ok(answer.stream(stream, asked).into_response())
    } else {
        answer.whole(stream, asked.logprobs).await
    }
}

/// The body as JSON, with the path of a field of the wrong type.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid("body", format!("the body is not valid JSON: {inner}"))
        } else {
            let param = if path == "." { "body".to_owned() } else { path };
            ApiError::invalid(&param, format!("{param}: {inner}"))
        }
    })
}

/// The request's fields checked against what this server offers.
fn check(state: &AppState, r: ChatRequest) -> Result<(Completion, Asked), ApiError> {
    let Ok(adapter) = state.adapter_of(&r.model) else {
        let served: Vec<String> = (state.served_ids().iter())
            .map(|id| format!("'{id}'"))
            .collect();
        return Err(ApiError::invalid(
            "model",
            format!(
                "model '{}' is not served here; this server serves {}",
                r.model,
                served.join(", ")
            ),
        )
        .code("model_not_found"));
    };
    if r.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.into_iter().enumerate() {
        let param = format!("messages[{i}].content");
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    if part.kind != "text" {
                        return Err(ApiError::invalid(
                            &param,
                            format!("content parts of type '{}' are not supported", part.kind),
                        ));
                    }
                    text.push_str(part.text.as_deref().unwrap_or_default());
                }
                text
            }
        };
        if !matches!(
            m.role.as_str(),
            "system" | "developer" | "user" | "assistant"
        ) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!("role '{}' is not supported", m.role),
            ));
        }
        messages.push(Message::new(m.role, content));
    }
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n", "only n = 1 is offered"));
    }
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid("tools", "tools are not supported"));
    }
    let constraint = match r.response_format {
        None => None,
        Some(format) => match format.kind.as_str() {
            "text" => None,
            "json_object" => Some(Constraint::JsonObject),
            "json_schema" => {
                let schema = format
                    .json_schema
                    .and_then(|j| j.schema)
                    .filter(serde_json::Value::is_object)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "response_format.json_schema.schema",
                            "a json_schema response format needs a schema object",
                        )
                    })?;
                Some(Constraint::JsonSchema(schema))
            }
            other => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!("response_format of type '{other}' is not supported"),
                ))
            }
        },
    };
    let max_tokens = r
        .max_completion_tokens
        .or(r.max_tokens)
        .map_or(state.default_max_tokens, |n| n as usize);
    if max_tokens == 0 {
        return Err(ApiError::invalid(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    let temperature = r.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            "temperature must be in [0, 2]",
        ));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", "top_p must be in (0, 1]"));
    }
    let mut sampling = Sampling::greedy().temperature(temperature).top_p(top_p);
    if let Some(seed) = r.seed {
        sampling = sampling.seed(seed as u64);
    }
    if let Some(bias) = r.logit_bias {
        let mut biases = Vec::with_capacity(bias.len());
        for (token, b) in bias {
            let id = token
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < state.vocab_size)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!("'{token}' is not a token id of this model's vocabulary"),
                    )
                })?;
            if !(-100.0..=100.0).contains(&b) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    "biases must be in [-100, 100]",
                ));
            }
            biases.push((id, b));
        }
        sampling = sampling.logit_bias(biases);
    }
    let logprobs = r.logprobs.unwrap_or(false);
    let top = r.top_logprobs.unwrap_or(0);
    if top > MAX_TOP_LOGPROBS {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs must be at most 20",
        ));
    }
    if top > 0 && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let stop = match r.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 {
        return Err(ApiError::invalid("stop", "at most 4 stop strings"));
    }
    let mut completion = Completion::new(messages)
        .max_tokens(max_tokens)
        .sampling(sampling)
        .stop(stop)
        .deadline(Instant::now() + state.request_timeout);
    if logprobs {
        completion = completion.logprobs(top as usize);
    }
    if let Some(constraint) = constraint {
        completion = completion.constraint(constraint);
    }
    if let Some(adapter) = adapter {
        completion = completion.adapter(adapter);
    }
    let stream = r.stream.unwrap_or(false);
    let asked = Asked {
        stream,
        include_usage: stream
            && r.stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        logprobs,
        model: r.model,
    };
    Ok((completion, asked))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(finish: &Finish) -> Usage {
    Usage {
        prompt_tokens: finish.prompt_tokens,
        completion_tokens: finish.completion_tokens,
        total_tokens: finish.prompt_tokens + finish.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: finish.cached_tokens,
        },
    }
}

fn reason(finish: &Finish) -> &'static str {
    match finish.reason {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

fn wire_logprobs((chosen, top): (TokenLogprob, Vec<TokenLogprob>)) -> TokenLogprobs {
    TokenLogprobs {
        bytes: chosen.text.as_bytes().to_vec(),
        token: chosen.text,
        logprob: chosen.logprob,
        top_logprobs: top
            .into_iter()
            .map(|t| TopLogprob {
                bytes: t.text.as_bytes().to_vec(),
                token: t.text,
                logprob: t.logprob,
            })
            .collect(),
    }
}

/// The answer's identity, the same in every chunk.
struct Answer {
    id: String,
    created: u64,
    model: String,
}

impl Answer {
    async fn whole(
        self,
        mut stream: CompletionStream,
        logprobs: bool,
    ) -> Result<Response, ApiError> {
        let mut text = String::new();
        let mut entries = Vec::new();
        loop {
            match stream.next().await {
                Some(StreamEvent::Token {
                    text: piece,
                    logprobs: lp,
                    ..
                }) => {
                    text.push_str(&piece);
                    entries.extend(lp.map(wire_logprobs));
                }
                Some(StreamEvent::Text(piece)) => text.push_str(&piece),
                Some(StreamEvent::Finished(finish)) => {
                    let body = ChatCompletion {
                        id: self.id,
                        object: "chat.completion",
                        created: self.created,
                        model: self.model,
                        choices: vec![Choice {
                            index: 0,
                            message: AssistantMessage {
                                role: "assistant",
                                content: text,
                            },
                            logprobs: logprobs.then_some(Logprobs { content: entries }),
                            finish_reason: reason(&finish),
                        }],
                        usage: usage(&finish),
                    };
                    return Ok(Json(body).into_response());
                }
                Some(StreamEvent::Failed(e)) => return Err(ApiError::from_engine(&e)),
                Some(_) => {}
                None => return Err(ApiError::from_engine(&mlx_engine::EngineError::Closed)),
            }
        }
    }

    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> Event {
        let chunk = ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        };
        Event::default().data(serde_json::to_string(&chunk).unwrap_or_default())
    }

    /// Server-sent events: a first chunk with the role, one per token with
    /// text (or logprobs), the last with the finish reason, then (if asked)
    /// one with the usage and no choices, then `[DONE]`. A failure midway
    /// is an `error` object in place of the rest. Dropping the response
    /// (the client went away) drops the engine's stream, which cancels the
    /// row.
    fn stream(
        self,
        stream: CompletionStream,
        asked: Asked,
    ) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        enum Phase {
            Start,
            Tokens,
            Done,
        }
        let state = (self, stream, asked, Phase::Start);
        let events = stream::unfold(state, |(answer, mut stream, asked, phase)| async move {
            let choice = |delta: Delta, logprobs, finish_reason| ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason,
            };
            match phase {
                Phase::Start => {
                    let delta = Delta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    };
                    let event = answer.chunk(vec![choice(delta, None, None)], None);
                    Some((vec![event], (answer, stream, asked, Phase::Tokens)))
                }
                Phase::Done => None,
                Phase::Tokens => {
                    let mut events = Vec::new();
                    let mut done = false;
                    match stream.next().await {
                        Some(StreamEvent::Token { text, logprobs, .. }) => {
                            let lp = asked.logprobs.then(|| Logprobs {
                                content: logprobs.map(wire_logprobs).into_iter().collect(),
                            });
                            let delta = Delta {
                                role: None,
                                content: Some(text),
                            };
                            events.push(answer.chunk(vec![choice(delta, lp, None)], None));
                        }
                        Some(StreamEvent::Text(text)) => {
                            let delta = Delta {
                                role: None,
                                content: Some(text),
                            };
                            events.push(answer.chunk(vec![choice(delta, None, None)], None));
                        }
                        Some(StreamEvent::Finished(finish)) => {
                            let last = choice(Delta::default(), None, Some(reason(&finish)));
                            events.push(answer.chunk(vec![last], None));
                            if asked.include_usage {
                                events.push(answer.chunk(Vec::new(), Some(usage(&finish))));
                            }
                            events.push(Event::default().data("[DONE]"));
                            done = true;
                        }
                        Some(StreamEvent::Failed(e)) => {
                            let body = ApiError::from_engine(&e).body();
                            let data = serde_json::to_string(&body).unwrap_or_default();
                            events.push(Event::default().data(data));
                            events.push(Event::default().data("[DONE]"));
                            done = true;
                        }
                        Some(_) => {}
                        None => done = true,
                    }
                    let next = if done { Phase::Done } else { Phase::Tokens };
                    Some((events, (answer, stream, asked, next)))
                }
            }
        });
        let flat = futures_util::StreamExt::flat_map(events, |batch| {
            stream::iter(batch.into_iter().map(Ok::<Event, Infallible>))
        });
        Sse::new(flat)
            .keep_alive(axum::response::sse::KeepAlive::new().interval(Duration::from_secs(15)))
    }
}
