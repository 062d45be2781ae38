//! Property tests over the two parsers that read untrusted text: client
//! frames (`ClientFrame::parse`, protocol §3) and the command agent's stdout
//! lines (`parse_agent_line`, protocol §9). Neither may panic on any input,
//! and whatever they accept must carry exactly the fields of the input.
//!
//! The number of cases is bounded so that CI stays fast; set
//! `PROPTEST_CASES` to run more.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use linger::agent::command::{parse_agent_line, LineError, MAX_LINE_BYTES};
use linger::agent::AgentOutput;
use linger::protocol::{check_limits, ClientFrame, Mode, ReqId};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(256),
        // No regression files in the tree: a failure prints its input.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------ strategies

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
        // Strings that mean something here.
        prop::sample::select(vec![
            "control",
            "observe",
            "ping",
            "attach",
            "c_1",
            "",
            "completed",
            "failed",
        ])
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const FRAME_TYPES: &[&str] = &[
    "create",
    "attach",
    "detach",
    "message",
    "tool_result",
    "stop",
    "close",
    "ping",
];

/// Every field any client frame has.
const FRAME_FIELDS: &[&str] = &[
    "req",
    "title",
    "close_delay",
    "conversation_id",
    "last_seq",
    "mode",
    "text",
    "client_msg_id",
    "call_id",
    "output",
    "is_error",
];

/// A JSON object that looks like a client frame: a known `type` (or not),
/// known fields with values of any type, and some unknown fields.
fn frame_like() -> impl Strategy<Value = Value> {
    let ty = prop_oneof![
        4 => prop::sample::select(FRAME_TYPES).prop_map(|t| json!(t)),
        1 => json_value(),
    ];
    let fields = prop::collection::vec((prop::sample::select(FRAME_FIELDS), json_value()), 0..8);
    let extra = prop::collection::btree_map("[a-z_]{1,8}", json_value(), 0..3);
    (prop::option::weighted(0.95, ty), fields, extra).prop_map(|(ty, fields, extra)| {
        let mut object: Map<String, Value> = extra.into_iter().collect();
        for (name, value) in fields {
            object.insert(name.to_owned(), value);
        }
        if let Some(ty) = ty {
            object.insert("type".into(), ty);
        }
        Value::Object(object)
    })
}

fn req_id() -> impl Strategy<Value = Option<ReqId>> {
    prop::option::of(prop_oneof![
        any::<i64>().prop_map(ReqId::Int),
        ".{0,16}".prop_map(ReqId::Str),
    ])
}

/// A well-typed client frame (any sizes: limits are checked separately).
fn valid_frame() -> impl Strategy<Value = ClientFrame> {
    let id = ".{0,20}";
    let mode = prop::option::of(prop_oneof![Just(Mode::Control), Just(Mode::Observe)]);
    prop_oneof![
        (
            req_id(),
            prop::option::of(".{0,20}"),
            prop::option::of(".{0,10}")
        )
            .prop_map(|(req, title, close_delay)| ClientFrame::Create {
                req,
                title,
                close_delay
            }),
        (
            req_id(),
            id,
            prop::option::of(any::<u64>()),
            mode,
            prop::option::of(any::<bool>())
        )
            .prop_map(|(req, conversation_id, last_seq, mode, compact)| {
                ClientFrame::Attach {
                    req,
                    conversation_id,
                    last_seq,
                    mode,
                    compact,
                }
            }),
        (req_id(), id).prop_map(|(req, conversation_id)| ClientFrame::Detach {
            req,
            conversation_id
        }),
        (req_id(), id, ".{0,40}", prop::option::of(id)).prop_map(
            |(req, conversation_id, text, client_msg_id)| ClientFrame::Message {
                req,
                conversation_id,
                text,
                client_msg_id
            }
        ),
        (
            req_id(),
            id,
            id,
            json_value(),
            prop::option::of(any::<bool>())
        )
            .prop_map(|(req, conversation_id, call_id, output, is_error)| {
                ClientFrame::ToolResult {
                    req,
                    conversation_id,
                    call_id,
                    output,
                    is_error,
                }
            }),
        (req_id(), id).prop_map(|(req, conversation_id)| ClientFrame::Stop {
            req,
            conversation_id
        }),
        (req_id(), id).prop_map(|(req, conversation_id)| ClientFrame::Close {
            req,
            conversation_id
        }),
        req_id().prop_map(|req| ClientFrame::Ping { req }),
    ]
}

// ------------------------------------------------------- the round trip

/// A frame's type and its fields as JSON, written out by hand (not by
/// serde, so that a derive mistake cannot hide itself): `None` is absent.
fn frame_json(frame: &ClientFrame) -> Value {
    let mut o = Map::new();
    let mut put = |name: &str, value: Option<Value>| {
        if let Some(value) = value {
            o.insert(name.to_owned(), value);
        }
    };
    let req = |r: &Option<ReqId>| {
        r.as_ref().map(|r| match r {
            ReqId::Int(n) => json!(n),
            ReqId::Str(s) => json!(s),
        })
    };
    let mode = |m: &Option<Mode>| {
        m.map(|m| match m {
            Mode::Control => json!("control"),
            Mode::Observe => json!("observe"),
        })
    };
    let ty = match frame {
        ClientFrame::Create {
            req: r,
            title,
            close_delay,
        } => {
            put("req", req(r));
            put("title", title.as_ref().map(|t| json!(t)));
            put("close_delay", close_delay.as_ref().map(|t| json!(t)));
            "create"
        }
        ClientFrame::Attach {
            req: r,
            conversation_id,
            last_seq,
            mode: m,
            compact,
        } => {
            put("req", req(r));
            put("conversation_id", Some(json!(conversation_id)));
            put("last_seq", last_seq.map(|s| json!(s)));
            put("mode", mode(m));
            put("compact", compact.map(|c| json!(c)));
            "attach"
        }
        ClientFrame::Detach {
            req: r,
            conversation_id,
        } => {
            put("req", req(r));
            put("conversation_id", Some(json!(conversation_id)));
            "detach"
        }
        ClientFrame::Message {
            req: r,
            conversation_id,
            text,
            client_msg_id,
        } => {
            put("req", req(r));
            put("conversation_id", Some(json!(conversation_id)));
            put("text", Some(json!(text)));
            put("client_msg_id", client_msg_id.as_ref().map(|c| json!(c)));
            "message"
        }
        ClientFrame::ToolResult {
            req: r,
            conversation_id,
            call_id,
            output,
            is_error,
        } => {
            put("req", req(r));
            put("conversation_id", Some(json!(conversation_id)));
            put("call_id", Some(json!(call_id)));
            put("output", Some(output.clone()));
            put("is_error", is_error.map(|b| json!(b)));
            "tool_result"
        }
        ClientFrame::Stop {
            req: r,
            conversation_id,
        } => {
            put("req", req(r));
            put("conversation_id", Some(json!(conversation_id)));
            "stop"
        }
        ClientFrame::Close {
            req: r,
            conversation_id,
        } => {
            put("req", req(r));
            put("conversation_id", Some(json!(conversation_id)));
            "close"
        }
        ClientFrame::Ping { req: r } => {
            put("req", req(r));
            "ping"
        }
    };
    o.insert("type".into(), json!(ty));
    Value::Object(o)
}

/// The fields of a frame type, and whether each may be absent (`null`
/// counts as absent for those).
fn fields_of(ty: &str) -> &'static [(&'static str, bool)] {
    match ty {
        "create" => &[("req", true), ("title", true), ("close_delay", true)],
        "attach" => &[
            ("req", true),
            ("conversation_id", false),
            ("last_seq", true),
            ("mode", true),
            ("compact", true),
        ],
        "message" => &[
            ("req", true),
            ("conversation_id", false),
            ("text", false),
            ("client_msg_id", true),
        ],
        "tool_result" => &[
            ("req", true),
            ("conversation_id", false),
            ("call_id", false),
            ("output", false),
            ("is_error", true),
        ],
        "detach" | "stop" | "close" => &[("req", true), ("conversation_id", false)],
        "ping" => &[("req", true)],
        _ => &[],
    }
}

/// What a frame parsed from `input` must hold: its type and its own
/// fields, with unknown fields and `null` optional fields dropped.
fn expected_fields(input: &Value) -> Value {
    let ty = input["type"].as_str().unwrap_or("");
    let mut o = Map::new();
    o.insert("type".into(), json!(ty));
    for (name, optional) in fields_of(ty) {
        match input.get(*name) {
            None => {}
            Some(Value::Null) if *optional => {}
            Some(value) => {
                o.insert((*name).to_owned(), value.clone());
            }
        }
    }
    Value::Object(o)
}

/// Checks one parse of `text`: no panic (the caller runs it), an accepted
/// frame holds exactly the input's fields, a refusal keeps the `req` and
/// `conversation_id` it could read, and the size check does not panic.
fn check_parse(text: &str) -> Result<(), TestCaseError> {
    let parsed = ClientFrame::parse(text);
    let input: Option<Value> = serde_json::from_str(text).ok();
    match (&parsed, &input) {
        (Ok(frame), Some(input)) => {
            prop_assert_eq!(frame_json(frame), expected_fields(input), "input: {}", text);
            let _ = check_limits(frame);
        }
        (Ok(frame), None) => {
            prop_assert!(
                false,
                "accepted text that is not JSON: {:?} -> {:?}",
                text,
                frame
            )
        }
        (Err(e), Some(input)) => {
            let req = input
                .get("req")
                .and_then(|r| serde_json::from_value::<ReqId>(r.clone()).ok());
            prop_assert_eq!(&e.req, &req, "input: {}", text);
            let id = input
                .get("conversation_id")
                .and_then(Value::as_str)
                .map(str::to_owned);
            prop_assert_eq!(&e.conversation_id, &id, "input: {}", text);
            prop_assert!(!e.message.is_empty());
        }
        (Err(e), None) => {
            prop_assert_eq!(&e.req, &None);
            prop_assert!(e.message.starts_with("not JSON"), "{}", e.message);
        }
    }
    Ok(())
}

// ---------------------------------------------------------- client frames

proptest! {
    #![proptest_config(config())]

    #[test]
    fn frame_parse_survives_any_string(text in any::<String>()) {
        check_parse(&text)?;
    }

    #[test]
    fn frame_parse_survives_json_shaped_noise(text in r#"[\[\]{}",:0-9a-z_ .eE+-]{0,120}"#) {
        check_parse(&text)?;
    }

    #[test]
    fn frame_parse_survives_mutated_frames(frame in valid_frame(), cut in any::<prop::sample::Index>(), junk in ".{0,4}") {
        // A valid frame with bytes cut out and junk put in.
        let text = frame_json(&frame).to_string();
        let mut at = cut.index(text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        // Cut out the character at `at` (if any).
        let rest = text[at..].chars().next().map_or(at, |c| at + c.len_utf8());
        check_parse(&format!("{}{junk}{}", &text[..at], &text[rest..]))?;
    }

    #[test]
    fn frame_parse_of_wrongly_typed_frames(input in frame_like()) {
        check_parse(&input.to_string())?;
    }

    #[test]
    fn every_valid_frame_parses_to_itself(frame in valid_frame(), extra in prop::collection::btree_map("x[a-z]{0,6}", json_value(), 0..3)) {
        let mut value = frame_json(&frame);
        for (k, v) in extra {
            value[k] = v;
        }
        let text = value.to_string();
        let parsed = ClientFrame::parse(&text);
        // serde_json (without its `float_roundtrip` feature) may read a
        // float back one unit in the last place off what it wrote: compare
        // with the output as it reads back, the rest exactly.
        let mut frame = frame;
        if let ClientFrame::ToolResult { output, .. } = &mut frame {
            *output = serde_json::from_str(&output.to_string()).unwrap();
        }
        prop_assert_eq!(parsed.as_ref().ok(), Some(&frame), "input: {}", text);
    }

    #[test]
    fn deep_nesting_is_refused_without_a_crash(depth in 1usize..4000, objects in any::<bool>()) {
        let nested = if objects {
            format!("{}0{}", r#"{"a":"#.repeat(depth), "}".repeat(depth))
        } else {
            format!("{}0{}", "[".repeat(depth), "]".repeat(depth))
        };
        let text = format!(r#"{{"type":"tool_result","req":1,"conversation_id":"c","call_id":"k","output":{nested}}}"#);
        let parsed = ClientFrame::parse(&text);
        // serde_json stops at 128 levels; the frame itself is one.
        if depth < 127 {
            prop_assert!(parsed.is_ok(), "depth {}: {:?}", depth, parsed.err());
        } else {
            prop_assert!(parsed.is_err(), "depth {} accepted", depth);
        }
    }
}

// ---------------------------------------------------- command agent lines

const AGENT_KINDS: &[&str] = &[
    "text_delta",
    "assistant_message",
    "tool_call",
    "turn_finished",
];
const AGENT_FIELDS: &[&str] = &["text", "call_id", "name", "args", "status", "error"];

fn agent_line_like() -> impl Strategy<Value = Value> {
    let kind = prop_oneof![
        6 => prop::sample::select(AGENT_KINDS).prop_map(|k| json!(k)),
        1 => json_value(),
    ];
    let fields = prop::collection::vec((prop::sample::select(AGENT_FIELDS), json_value()), 0..6);
    (prop::option::weighted(0.95, kind), fields).prop_map(|(kind, fields)| {
        let mut object: Map<String, Value> =
            fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        if let Some(kind) = kind {
            object.insert("kind".into(), kind);
        }
        Value::Object(object)
    })
}

/// Checks one agent line: no panic (the caller runs it), and an accepted
/// line holds exactly what the input says.
fn check_agent_line(line: &str) -> Result<(), TestCaseError> {
    let parsed = parse_agent_line(line);
    let Ok(output) = parsed else {
        return Ok(());
    };
    let input: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            prop_assert!(
                false,
                "accepted a line that is not JSON ({}): {:?} -> {:?}",
                e,
                line,
                output
            );
            unreachable!()
        }
    };
    let field = |name: &str| input.get(name).cloned().unwrap_or(Value::Null);
    match (&output, input["kind"].as_str()) {
        (AgentOutput::TextDelta(text), Some("text_delta"))
        | (AgentOutput::AssistantMessage(text), Some("assistant_message")) => {
            prop_assert_eq!(json!(text), field("text"));
        }
        (
            AgentOutput::ToolCall {
                call_id,
                name,
                args,
            },
            Some("tool_call"),
        ) => {
            prop_assert!(!call_id.is_empty() && !name.is_empty());
            prop_assert_eq!(json!(call_id), field("call_id"));
            prop_assert_eq!(json!(name), field("name"));
            let want = match field("args") {
                Value::Null => json!({}),
                other => other,
            };
            prop_assert_eq!(args, &want);
        }
        (AgentOutput::Finished { failed: None }, Some("turn_finished")) => {
            prop_assert_eq!(field("status"), json!("completed"));
        }
        (
            AgentOutput::Finished {
                failed: Some(error),
            },
            Some("turn_finished"),
        ) => {
            prop_assert_eq!(field("status"), json!("failed"));
            match field("error") {
                Value::String(e) => prop_assert_eq!(error, &e),
                other => {
                    prop_assert_eq!(other, Value::Null);
                    prop_assert!(!error.is_empty());
                }
            }
        }
        (output, kind) => prop_assert!(false, "{:?} from kind {:?}: {}", output, kind, line),
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn agent_line_parse_survives_any_string(line in any::<String>()) {
        check_agent_line(&line)?;
    }

    #[test]
    fn agent_line_parse_survives_json_shaped_noise(line in r#"[\[\]{}",:0-9a-z_ .eE+-]{0,120}"#) {
        check_agent_line(&line)?;
    }

    #[test]
    fn agent_line_parse_of_wrongly_typed_lines(input in agent_line_like(), pad in "[ \t]{0,3}") {
        check_agent_line(&format!("{pad}{input}{pad}"))?;
    }

    #[test]
    fn agent_line_deep_nesting_is_refused_without_a_crash(depth in 1usize..4000) {
        let line = format!(
            r#"{{"kind":"tool_call","call_id":"c","name":"n","args":{}0{}}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let parsed = parse_agent_line(&line);
        if depth < 127 {
            prop_assert!(parsed.is_ok(), "depth {}: {:?}", depth, parsed.err());
        } else {
            prop_assert!(matches!(parsed, Err(LineError::NotJson(_))), "depth {}: {:?}", depth, parsed);
        }
    }
}

#[test]
fn an_agent_line_over_the_limit_is_refused_before_parsing() {
    let line = format!(
        r#"{{"kind":"text_delta","text":"{}"}}"#,
        "x".repeat(MAX_LINE_BYTES)
    );
    assert_eq!(
        parse_agent_line(&line),
        Err(LineError::TooLong {
            limit: MAX_LINE_BYTES
        })
    );
    let line = format!(
        r#"{{"kind":"text_delta","text":"{}"}}"#,
        "x".repeat(MAX_LINE_BYTES - 40)
    );
    assert_eq!(
        parse_agent_line(&line),
        Ok(AgentOutput::TextDelta("x".repeat(MAX_LINE_BYTES - 40)))
    );
}
