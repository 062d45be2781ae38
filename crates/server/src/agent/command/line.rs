//! The JSON-lines wire format between linger and an agent process
//! (protocol §9): the frames linger writes to the agent's stdin
//! ([`ToAgent`]), the lines the agent writes on stdout
//! ([`parse_agent_line`], [`LineError`]), and reading one line of bounded
//! length ([`read_bounded_line`]). No processes or tasks here: pure
//! encoding, decoding and framing.

use std::io;

use serde::Serialize;
use serde_json::{Map, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

use crate::agent::AgentOutput;

/// The longest line an agent may write on stdout. A longer one fails the
/// turn: the reader never holds more than this much of one line.
pub const MAX_LINE_BYTES: usize = 1024 * 1024;

/// How much of an agent's text an error message quotes.
const QUOTE_CHARS: usize = 64;

/// A line linger writes to the agent's stdin.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum ToAgent<'a> {
    /// `{"type":"turn","turn_id","text"}`: work on this message;
    /// `"resumed": true` when it re-runs an interrupted turn (protocol §11).
    Turn {
        turn_id: &'a str,
        text: &'a str,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        resumed: bool,
    },
    /// `{"type":"tool_result","call_id","output","is_error"}`: the client's
    /// answer to a `tool_call` of the current turn.
    ToolResult {
        call_id: &'a str,
        output: &'a Value,
        is_error: bool,
    },
    /// `{"type":"stop","turn_id"}`: end this turn now.
    Stop { turn_id: &'a str },
}

impl ToAgent<'_> {
    /// The frame as one line, newline included.
    pub(super) fn to_line(&self) -> Vec<u8> {
        let mut line =
            serde_json::to_vec(self).expect("string fields and a Value always serialize");
        line.push(b'\n');
        line
    }
}

/// Why a line from the agent is not valid (§9). Any of these fails the turn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("the line is longer than {limit} bytes")]
    TooLong { limit: usize },
    #[error("the line is not UTF-8")]
    NotUtf8,
    #[error("not JSON ({0})")]
    NotJson(String),
    #[error("not a JSON object")]
    NotObject,
    #[error("no string field \"kind\"")]
    MissingKind,
    #[error("unknown kind \"{0}\"")]
    UnknownKind(String),
    #[error("{kind} needs a {expected} field \"{field}\"")]
    BadField {
        kind: &'static str,
        field: &'static str,
        expected: &'static str,
    },
    #[error("turn_finished has status \"{0}\", not completed or failed")]
    BadStatus(String),
}

/// Parses one line the agent wrote on stdout (without its newline) into what
/// it reports. Pure, and total: any input gives a value or an error.
pub fn parse_agent_line(line: &str) -> Result<AgentOutput, LineError> {
    if line.len() > MAX_LINE_BYTES {
        return Err(LineError::TooLong {
            limit: MAX_LINE_BYTES,
        });
    }
    let value: Value = serde_json::from_str(line).map_err(|e| LineError::NotJson(e.to_string()))?;
    let Value::Object(mut fields) = value else {
        return Err(LineError::NotObject);
    };
    let kind = match fields.remove("kind") {
        Some(Value::String(kind)) => kind,
        _ => return Err(LineError::MissingKind),
    };
    match kind.as_str() {
        "text_delta" => Ok(AgentOutput::TextDelta(string_field(
            &mut fields,
            "text_delta",
            "text",
        )?)),
        "assistant_message" => Ok(AgentOutput::AssistantMessage(string_field(
            &mut fields,
            "assistant_message",
            "text",
        )?)),
        "tool_call" => {
            let call_id = id_field(&mut fields, "tool_call", "call_id")?;
            let name = id_field(&mut fields, "tool_call", "name")?;
            // Arguments are optional: a tool may take none.
            let args = match fields.remove("args") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(args) => args,
            };
            Ok(AgentOutput::ToolCall {
                call_id,
                name,
                args,
            })
        }
        "turn_finished" => {
            let status = string_field(&mut fields, "turn_finished", "status")?;
            match status.as_str() {
                "completed" => Ok(AgentOutput::Finished { failed: None }),
                "failed" => {
                    let error = match fields.remove("error") {
                        None | Some(Value::Null) => "the agent reported the turn failed".to_owned(),
                        Some(Value::String(error)) => error,
                        Some(_) => {
                            return Err(LineError::BadField {
                                kind: "turn_finished",
                                field: "error",
                                expected: "string",
                            })
                        }
                    };
                    Ok(AgentOutput::Finished {
                        failed: Some(error),
                    })
                }
                _ => Err(LineError::BadStatus(quote(&status))),
            }
        }
        _ => Err(LineError::UnknownKind(quote(&kind))),
    }
}

fn string_field(
    fields: &mut Map<String, Value>,
    kind: &'static str,
    field: &'static str,
) -> Result<String, LineError> {
    match fields.remove(field) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(LineError::BadField {
            kind,
            field,
            expected: "string",
        }),
    }
}

fn id_field(
    fields: &mut Map<String, Value>,
    kind: &'static str,
    field: &'static str,
) -> Result<String, LineError> {
    match fields.remove(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        _ => Err(LineError::BadField {
            kind,
            field,
            expected: "non-empty string",
        }),
    }
}

/// The start of an agent-supplied string, for an error message.
fn quote(text: &str) -> String {
    quote_n(text, QUOTE_CHARS)
}

/// The first `max_chars` characters of `text`, with `…` when cut.
pub(super) fn quote_n(text: &str, max_chars: usize) -> String {
    let mut chars = text.chars();
    let mut quoted: String = chars.by_ref().take(max_chars).collect();
    if chars.next().is_some() {
        quoted.push('…');
    }
    quoted
}

/// What [`read_bounded_line`] read.
pub(super) enum LineRead {
    Line,
    Eof,
    TooLong,
}

/// Reads one line into `buf` (newline and all), never more than `max` bytes
/// of content: past that it stops and reports `TooLong`.
pub(super) async fn read_bounded_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    let n = (&mut *reader).take(limit).read_until(b'\n', buf).await?;
    if n == 0 {
        Ok(LineRead::Eof)
    } else if buf.last() != Some(&b'\n') && buf.len() > max {
        Ok(LineRead::TooLong)
    } else {
        // Either a whole line, or the last one without its newline.
        Ok(LineRead::Line)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tokio::io::BufReader;

    use super::*;

    fn failed(error: &str) -> AgentOutput {
        AgentOutput::Finished {
            failed: Some(error.into()),
        }
    }

    #[test]
    fn parses_every_kind() {
        assert_eq!(
            parse_agent_line(r#"{"kind":"text_delta","text":"hel"}"#),
            Ok(AgentOutput::TextDelta("hel".into()))
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"assistant_message","text":"hello"}"#),
            Ok(AgentOutput::AssistantMessage("hello".into()))
        );
        assert_eq!(
            parse_agent_line(
                r#"{"kind":"tool_call","call_id":"c1","name":"confirm","args":{"q":1}}"#
            ),
            Ok(AgentOutput::ToolCall {
                call_id: "c1".into(),
                name: "confirm".into(),
                args: json!({"q": 1}),
            })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"completed"}"#),
            Ok(AgentOutput::Finished { failed: None })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"failed","error":"boom"}"#),
            Ok(failed("boom"))
        );
    }

    #[test]
    fn lenient_where_it_costs_nothing() {
        // Extra fields are for later versions; whitespace around is fine.
        assert_eq!(
            parse_agent_line(r#"  {"kind":"text_delta","text":"x","extra":[1]} "#),
            Ok(AgentOutput::TextDelta("x".into()))
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"tool_call","call_id":"c","name":"n"}"#),
            Ok(AgentOutput::ToolCall {
                call_id: "c".into(),
                name: "n".into(),
                args: json!({}),
            })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"failed"}"#),
            Ok(failed("the agent reported the turn failed"))
        );
        // An error on a completed turn is not an error.
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"completed","error":"x"}"#),
            Ok(AgentOutput::Finished { failed: None })
        );
    }

    #[test]
    fn rejects_invalid_lines() {
        assert!(matches!(
            parse_agent_line("hello"),
            Err(LineError::NotJson(_))
        ));
        assert!(matches!(parse_agent_line(""), Err(LineError::NotJson(_))));
        assert_eq!(parse_agent_line("[1,2]"), Err(LineError::NotObject));
        assert_eq!(parse_agent_line(r#""text""#), Err(LineError::NotObject));
        assert_eq!(
            parse_agent_line(r#"{"text":"x"}"#),
            Err(LineError::MissingKind)
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":7,"text":"x"}"#),
            Err(LineError::MissingKind)
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"shout","text":"x"}"#),
            Err(LineError::UnknownKind("shout".into()))
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"text_delta"}"#),
            Err(LineError::BadField {
                kind: "text_delta",
                field: "text",
                expected: "string"
            })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"assistant_message","text":42}"#),
            Err(LineError::BadField {
                kind: "assistant_message",
                field: "text",
                expected: "string"
            })
        );
        assert!(matches!(
            parse_agent_line(r#"{"kind":"tool_call","call_id":"","name":"n"}"#),
            Err(LineError::BadField {
                field: "call_id",
                ..
            })
        ));
        assert!(matches!(
            parse_agent_line(r#"{"kind":"tool_call","call_id":"c"}"#),
            Err(LineError::BadField { field: "name", .. })
        ));
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"stopped"}"#),
            Err(LineError::BadStatus("stopped".into()))
        );
        assert!(matches!(
            parse_agent_line(r#"{"kind":"turn_finished"}"#),
            Err(LineError::BadField {
                field: "status",
                ..
            })
        ));
        assert!(matches!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"failed","error":{}}"#),
            Err(LineError::BadField { field: "error", .. })
        ));
        // Two objects on one line are not one line of JSON.
        assert!(matches!(
            parse_agent_line(r#"{"kind":"text_delta","text":"a"}{"kind":"text_delta","text":"b"}"#),
            Err(LineError::NotJson(_))
        ));
    }

    #[test]
    fn messages_are_short_and_clear() {
        let long_kind = "k".repeat(10_000);
        let line = format!(r#"{{"kind":"{long_kind}"}}"#);
        let error = parse_agent_line(&line).unwrap_err().to_string();
        assert!(error.len() < 120, "{error}");
        assert!(error.starts_with("unknown kind"), "{error}");
        let error = parse_agent_line(r#"{"kind":"text_delta"}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(error, r#"text_delta needs a string field "text""#);
    }

    #[test]
    fn too_long_lines_are_rejected_before_parsing() {
        let line = format!(
            r#"{{"kind":"text_delta","text":"{}"}}"#,
            "a".repeat(MAX_LINE_BYTES)
        );
        assert_eq!(
            parse_agent_line(&line),
            Err(LineError::TooLong {
                limit: MAX_LINE_BYTES
            })
        );
    }

    #[test]
    fn never_panics() {
        // Deep nesting, odd escapes, truncations of valid lines, multibyte
        // text cut anywhere, and pseudo-random bytes.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse_agent_line(&deep).is_err());
        let deep_obj = format!(
            r#"{{"kind":"tool_call","call_id":"c","name":"n","args":{}1{}}}"#,
            "[".repeat(5_000),
            "]".repeat(5_000)
        );
        assert!(parse_agent_line(&deep_obj).is_err());
        let valid = r#"{"kind":"tool_call","call_id":"c\u00e9","name":"é😀","args":{"a":[1,2.5e300,null,true,"\ud83d\ude00"]}}"#;
        for (i, _) in valid.char_indices() {
            let _ = parse_agent_line(&valid[..i]);
            let _ = parse_agent_line(&valid[i..]);
        }
        let _ = parse_agent_line(r#"{"kind":"text_delta","text":"\ud800"}"#);
        let _ = parse_agent_line(r#"{"kind":"text_delta","text":"\u0000"}"#);
        let _ = parse_agent_line("1e999999");
        let _ = parse_agent_line("-");
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let alphabet = br#"{}[]":,\ 0123456789.eE+-truefalsnkindtext_delta"#;
        for _ in 0..20_000 {
            let len = (seed % 40) as usize;
            let mut bytes = Vec::with_capacity(len);
            for _ in 0..len {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                bytes.push(alphabet[(seed % alphabet.len() as u64) as usize]);
            }
            if let Ok(text) = std::str::from_utf8(&bytes) {
                let _ = parse_agent_line(text);
            }
        }
    }

    #[test]
    fn quotes_are_cut_on_char_boundaries() {
        assert_eq!(quote("abc"), "abc");
        let long = "é".repeat(100);
        let quoted = quote(&long);
        assert_eq!(quoted.chars().count(), QUOTE_CHARS + 1);
        assert!(quoted.ends_with('…'));
    }

    #[test]
    fn frames_to_the_agent_are_one_json_line_each() {
        let line = |frame: ToAgent| {
            let bytes = frame.to_line();
            assert_eq!(bytes.last(), Some(&b'\n'));
            assert_eq!(bytes.iter().filter(|b| **b == b'\n').count(), 1);
            serde_json::from_slice::<Value>(&bytes).unwrap()
        };
        assert_eq!(
            line(ToAgent::Turn {
                turn_id: "t1",
                text: "two\nlines",
                resumed: false,
            }),
            json!({"type": "turn", "turn_id": "t1", "text": "two\nlines"})
        );
        assert_eq!(
            line(ToAgent::Turn {
                turn_id: "t2",
                text: "again",
                resumed: true,
            }),
            json!({"type": "turn", "turn_id": "t2", "text": "again", "resumed": true})
        );
        assert_eq!(
            line(ToAgent::ToolResult {
                call_id: "c1",
                output: &json!({"ok": [1]}),
                is_error: false
            }),
            json!({"type": "tool_result", "call_id": "c1", "output": {"ok": [1]}, "is_error": false})
        );
        assert_eq!(
            line(ToAgent::Stop { turn_id: "t1" }),
            json!({"type": "stop", "turn_id": "t1"})
        );
    }

    #[tokio::test]
    async fn bounded_reader_stops_at_the_limit() {
        let data: &[u8] = b"short\n0123456789\nthis one is too long\nlast";
        let mut reader = BufReader::new(data);
        let mut buf = Vec::new();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Line)
        ));
        assert_eq!(buf, b"short\n");
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Line)
        ));
        assert_eq!(buf, b"0123456789\n");
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::TooLong)
        ));
        assert_eq!(buf.len(), 11);
        // The rest of that line is never read by the session (it discards
        // the process); read on to check the tail.
        buf.clear();
        let _ = read_bounded_line(&mut reader, &mut buf, 100).await;
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Line)
        ));
        assert_eq!(buf, b"last");
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Eof)
        ));
    }
}
