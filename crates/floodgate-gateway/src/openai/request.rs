//! Request bodies the gateway reads before admission: a streaming completion rewritten to ask
//! the upstream for its usage, a Responses API create checked for what cannot be metered.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

/// A streaming completion request, as the gateway forwards it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamRequest {
    /// Whether the caller itself asked for the usage chunk.
    pub caller_wants_usage: bool,
}

/// A JSON object's top-level fields in the order they came, each value kept as its raw text: a
/// request is rewritten without building a tree of its (possibly large) values. Keys and values
/// are borrowed from the body (a key is copied only if it has an escape to undo), so that reading
/// a request allocates nothing but this list.
struct TopLevel<'a>(Vec<Field<'a>>);

/// The most top-level members a body read before admission may have. A request names a few
/// dozen; the list of them costs 40 bytes a member, so a body of `"a":0,` repeated would cost
/// seven times its length to parse if nothing stopped it (docs/gateway.md, "Requests and
/// responses").
const MAX_FIELDS: usize = 1024;

/// Why a body with more than [`MAX_FIELDS`] members is refused.
const TOO_MANY_FIELDS: &str = "The request body has more than 1024 top-level members.";

/// The longest `stream_options` value rewritten (its members are taken apart to set
/// `include_usage`): the API's options are a few bytes.
const MAX_STREAM_OPTIONS: usize = 4096;

/// A top-level field: its key and its value's raw text.
type Field<'a> = (Key<'a>, &'a RawValue);

/// A key as the body spells it once unescaped: borrowed unless it had an escape.
struct Key<'a>(Cow<'a, str>);

impl PartialEq<str> for Key<'_> {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> serde::de::Visitor<'de> for Text {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(Text)
    }
}

impl<'de> Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = TopLevel<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<TopLevel<'de>, A::Error> {
                let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(field) = map.next_entry::<Key<'de>, &'de RawValue>()? {
                    if fields.len() == MAX_FIELDS {
                        return Err(serde::de::Error::custom(TOO_MANY_FIELDS));
                    }
                    fields.push(field);
                }
                Ok(TopLevel(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// What a request says of its output, for the estimate a reservation charges: its cap and how
/// many outputs it asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutputCap {
    /// `max_completion_tokens`, else `max_tokens`, else `max_output_tokens` (Responses API), if
    /// one is a non-negative integer.
    pub cap: Option<u64>,
    /// How many outputs are generated: `n` (or `best_of`, on the legacy completions API, if
    /// larger), 1 when absent.
    pub choices: u64,
}

impl OutputCap {
    /// The output's estimate: the cap, or `default` for a request that names none, times the
    /// outputs asked for.
    pub fn tokens(&self, default: u64) -> u64 {
        self.cap
            .unwrap_or(default)
            .saturating_mul(self.choices.max(1))
    }

    /// What `fields` (a request's top level) say. A cap or count that is not a non-negative
    /// integer counts as absent: the upstream refuses such a request, after admission.
    fn of(fields: &[Field<'_>]) -> OutputCap {
        let int = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| v.get().parse::<u64>().ok())
        };
        let cap = int("max_completion_tokens")
            .or_else(|| int("max_tokens"))
            .or_else(|| int("max_output_tokens"));
        let choices = int("n").unwrap_or(1).max(int("best_of").unwrap_or(1));
        OutputCap { cap, choices }
    }
}

/// The tokens a request is estimated to use, the most it can: a bound on its prompt plus its
/// output cap ([`OutputCap::tokens`]).
///
/// The prompt's bound is the body's length in bytes. Every tokenizer of the OpenAI family (and
/// the byte-level BPEs of the others) maps each token to at least one byte of text, and the
/// body holds all of the prompt's text (JSON escapes only lengthen it) plus its structure, which
/// more than covers the few tokens a message's framing costs. So the bound never under-counts
/// text; it over-counts by the bytes per token of the text (about 4 for English) and by the
/// JSON around it (docs/gateway.md, "Token reservation", has the figures). An image sent by URL
/// is the exception: its tokens depend on its size, which the body does not show.
pub fn estimate(body_len: usize, output: OutputCap, default_output: u64) -> Estimate {
    Estimate {
        prompt: u64::try_from(body_len).unwrap_or(u64::MAX),
        output: output.tokens(default_output),
        named_cap: output.cap.is_some(),
        choices: output.choices.max(1),
    }
}

/// A request's estimate of its tokens ([`estimate`]), in its two parts, so that a request that
/// can never fit a limit is told which to lower.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Estimate {
    /// The bound on the prompt: the body's length in bytes.
    pub prompt: u64,
    /// The output cap times the outputs asked for.
    pub output: u64,
    /// Whether the request named its cap (else the output is `default_max_output_tokens`).
    pub named_cap: bool,
    /// How many outputs the cap is reserved for ([`OutputCap::choices`]), at least 1.
    pub choices: u64,
}

impl Estimate {
    /// The whole estimate: prompt plus output.
    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.output)
    }

    /// The message of the 400 for an estimate above a limit of `max` tokens (`limit` names it,
    /// as "org token limit of 1000 tokens per 60s"), which no wait would let through: what it
    /// reserves, and what to lower. The output cap is reserved once per choice (`n`), so the
    /// cap that fits is what the prompt leaves, divided by the choices.
    pub fn cannot_fit(&self, limit: &str, max: u64) -> String {
        let Estimate { prompt, output, .. } = *self;
        let n = self.choices.max(1);
        let per_choice = output / n;
        let output = if n > 1 {
            format!("{output} of output, {per_choice} for each of its {n} choices (`n`)")
        } else {
            format!("{output} of output")
        };
        let caps = "`max_tokens` (`max_completion_tokens`, `max_output_tokens`)";
        let room = max.saturating_sub(prompt);
        let fits = room / n;
        let lower = if room == 0 {
            "send a shorter prompt".to_owned()
        } else if fits == 0 {
            format!("lower `n` to at most {room}, and {caps} to at most {room} divided by `n`")
        } else {
            let or_n = if n > 1 { ", or lower `n`" } else { "" };
            if self.named_cap {
                format!("lower {caps} to at most {fits}{or_n}")
            } else {
                let each = if n > 1 { " for each choice" } else { "" };
                format!(
                    "set {caps} to at most {fits}{or_n}: the request names no cap, so the \
                     gateway's default of {per_choice} is assumed{each}"
                )
            }
        };
        format!(
            "This request can never fit the {limit}: it reserves up to {} tokens ({prompt} for \
             the prompt, bounded by its length in bytes, plus {output}). To fit, {lower}.",
            self.total()
        )
    }
}

/// A metered completion request, prepared for the upstream.
#[derive(Debug)]
pub struct Prepared {
    /// The body to forward.
    pub body: Bytes,
    /// For a streaming request, what the caller asked for.
    pub stream: Option<StreamRequest>,
    /// The `model` the request names (a string), which prices its spend when the response
    /// names none.
    pub model: Option<String>,
    /// What it says of its output.
    pub output: OutputCap,
}

/// Prepares a metered completion request body: a streaming request (`"stream": true`) is
/// rewritten to ask the upstream for usage. Returns the body to forward, what a streaming
/// request's caller asked for, and (with `want_model`: for a chain with budgets) the model named.
///
/// Refused (the caller gets 400, nothing is charged) where the gateway cannot tell for sure
/// whether the upstream will stream, since a stream it did not ask usage for would go
/// uncharged: a body that is not a strict JSON object (a lenient upstream may still read one
/// with a byte-order mark or a `NaN` in it), a `stream` that is not `true`, `false` or `null`
/// (some servers take `1` or `"true"` for true), and a body that names `stream` or
/// `stream_options` twice (servers differ on which one counts).
pub fn prepare_request(body: Bytes, want_model: bool) -> Result<Prepared, String> {
    let fields = match serde_json::from_slice::<TopLevel>(&body) {
        Ok(TopLevel(fields)) => fields,
        Err(e) if e.to_string().starts_with(TOO_MANY_FIELDS) => {
            return Err(TOO_MANY_FIELDS.into());
        }
        Err(_) => return Err("The request body is not a JSON object.".into()),
    };
    no_case_variants(&fields)?;
    let field = |name: &str| unique_field(&fields, name);
    let stream = field("stream")?;
    let options = field("stream_options")?;
    let output = OutputCap::of(&fields);
    let model = named_model(&fields, want_model);
    match stream.map(RawValue::get) {
        Some("true") => {}
        None | Some("false" | "null") => {
            return Ok(Prepared {
                body,
                stream: None,
                model,
                output,
            });
        }
        Some(_) => return Err("`stream` must be true or false.".into()),
    }
    if options.is_none() {
        // The common case, no options: the body as it came, one member added before its
        // closing brace (the parse above proved it a JSON object, so its last byte but any
        // trailing space is that brace).
        let close = body.trim_ascii_end().len() - 1;
        let mut out = Vec::with_capacity(body.len() + USAGE_OPTION.len() + 1);
        out.extend_from_slice(&body[..close]);
        if !fields.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(USAGE_OPTION);
        out.push(b'}');
        return Ok(Prepared {
            body: Bytes::from(out),
            stream: Some(StreamRequest {
                caller_wants_usage: false,
            }),
            model,
            output,
        });
    }
    if options.is_some_and(|o| o.get().len() > MAX_STREAM_OPTIONS) {
        return Err(format!(
            "stream_options is longer than {MAX_STREAM_OPTIONS} bytes."
        ));
    }
    // The caller's options, with include_usage set; each field once (a duplicate
    // include_usage would leave the choice to the upstream's parser). The values stay as they
    // came: a number no f64 holds (`1e400`) is still JSON, and must not lose the caller's
    // other options, include_usage among them.
    let mut opts: std::collections::BTreeMap<String, Box<RawValue>> = options
        .and_then(|o| serde_json::from_str(o.get()).ok())
        .unwrap_or_default();
    // Every spelling a case-blind server reads as `include_usage` goes, so that the one set
    // here is the only one ([`folds_to`]).
    let mut asked = StreamRequest {
        caller_wants_usage: false,
    };
    opts.retain(|k, v| {
        let usage = folds_to(k, "include_usage");
        asked.caller_wants_usage |= usage && v.get().trim() == "true";
        !usage
    });
    let yes = RawValue::from_string("true".into()).map_err(|e| e.to_string())?;
    opts.insert("include_usage".into(), yes);
    let opts = serde_json::to_string(&opts).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(body.len() + 32);
    out.push(b'{');
    for (k, v) in &fields {
        if k == "stream_options" {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, &*k.0).map_err(|e| e.to_string())?;
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"stream_options\":");
    out.extend_from_slice(opts.as_bytes());
    out.push(b'}');
    Ok(Prepared {
        body: Bytes::from(out),
        stream: Some(asked),
        model,
        output,
    })
}

/// The member a stream request without options gets, so that its stream reports usage.
const USAGE_OPTION: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// The top-level field `name` of a request body, if present; an error (for a 400) if it is
/// named twice, since servers differ on which one counts, or named in another letter case
/// (`"Stream"`), which some servers read as `name` and others ignore ([`folds_to`]).
fn unique_field<'a>(fields: &[Field<'a>], name: &str) -> Result<Option<&'a RawValue>, String> {
    let mut found = fields.iter().filter(|(k, _)| folds_to(&k.0, name));
    let first = found.next();
    if found.next().is_some() {
        return Err(format!(
            "The request body has more than one `{name}` field."
        ));
    }
    match first {
        Some((k, _)) if *k != *name => Err(format!(
            "The request body has a field that differs from `{name}` only in letter case: \
             name it `{name}`."
        )),
        _ => Ok(first.map(|&(_, v)| v)),
    }
}

/// The `model` a request body names (with `want_model`: for a chain with budgets), which prices
/// its estimate and a response that names none. Read only to price: a duplicate or a non-string
/// is no model rather than an error.
fn named_model(fields: &[Field<'_>], want_model: bool) -> Option<String> {
    if !want_model {
        return None;
    }
    unique_field(fields, "model").ok().flatten().and_then(|m| {
        match super::json::plain_string(m.get().as_bytes()) {
            // The common spelling, read without the parser: a string without escapes.
            Some(plain) => plain.map(str::to_owned),
            None => serde_json::from_str::<String>(m.get()).ok(),
        }
    })
}

/// The fields the gateway reads for an estimate or a price: what [`OutputCap::of`] reads, and
/// the model.
const READ_FIELDS: [&str; 6] = [
    "max_completion_tokens",
    "max_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "model",
];

/// An error (for a 400) if one of [`READ_FIELDS`] is named twice, or a top-level key is one
/// of them in another letter case ([`folds_to`]): a case-blind server would read it (a cap the estimate did not count, say)
/// where the gateway does not. The OpenAI API refuses a field it does not know, so no caller
/// of it sends one.
fn no_case_variants(fields: &[Field<'_>]) -> Result<(), String> {
    let mut seen = [false; READ_FIELDS.len()];
    for (key, _) in fields {
        // A key in lowercase ASCII is a variant of no lowercase name but itself.
        if key
            .0
            .bytes()
            .all(|b| b.is_ascii() && !b.is_ascii_uppercase())
        {
            // Named twice, the estimate would read the first where most servers read the last.
            if let Some(i) = READ_FIELDS.iter().position(|name| *key == **name)
                && std::mem::replace(&mut seen[i], true)
            {
                let name = READ_FIELDS[i];
                return Err(format!(
                    "The request body has more than one `{name}` field."
                ));
            }
            continue;
        }
        if let Some(name) = READ_FIELDS.iter().find(|name| folds_to(&key.0, name)) {
            return Err(format!(
                "The request body has a field that differs from `{name}` only in letter case: \
                 name it `{name}`."
            ));
        }
    }
    Ok(())
}

/// Whether `key` is `name` (ASCII lowercase) to a server that matches field names ignoring
/// case, as Go's `encoding/json` does (servers written in Go answer the OpenAI API): ASCII
/// letters in either case, and the two other characters that fold to ASCII letters, `ſ`
/// (U+017F, to `s`) and the Kelvin sign (U+212A, to `k`). A `"Stream": true` such a server
/// streams would otherwise pass here as no stream, and its answer go uncharged
/// (docs/gateway.md, "Requests and responses").
fn folds_to(key: &str, name: &str) -> bool {
    let mut name = name.bytes();
    let same = key.chars().all(|c| {
        let folded = match c {
            '\u{017F}' => 's',
            '\u{212A}' => 'k',
            c => c.to_ascii_lowercase(),
        };
        name.next().is_some_and(|n| char::from(n) == folded)
    });
    same && name.next().is_none()
}

/// Checks a metered Responses API create body. Refused (the caller gets 400, nothing is
/// charged): a background response (`"background": true`), which is answered at once without
/// usage and finishes later, its usage then only in fetches of the stored response, which are
/// never charged (see [`is_generating_request`]): the gateway could not charge it at all. Also
/// refused, as for completions, where the upstream's reading is not certain: a body that is not
/// a strict JSON object, a `background` other than `true`, `false` or `null`, or one named
/// twice. The body is forwarded as sent; what it says of its output is returned, and (with
/// `want_model`) the model it names, as [`prepare_request`] reads it.
pub fn check_responses_request(
    body: &[u8],
    want_model: bool,
) -> Result<(OutputCap, Option<String>), String> {
    let Ok(TopLevel(fields)) = serde_json::from_slice::<TopLevel>(body) else {
        return Err("The request body is not a JSON object.".into());
    };
    no_case_variants(&fields)?;
    match unique_field(&fields, "background")?.map(RawValue::get) {
        None | Some("false" | "null") => {
            Ok((OutputCap::of(&fields), named_model(&fields, want_model)))
        }
        Some("true") => Err(
            "Background responses are not available through this gateway: their tokens could \
             not be counted against your limits. Send the request without `background`."
                .into(),
        ),
        Some(_) => Err("`background` must be true or false.".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_read_as_a_json_string_escapes_undone() {
        let model = |body: &'static [u8]| {
            prepare_request(Bytes::from_static(body), true)
                .unwrap()
                .model
        };
        assert_eq!(model(br#"{"model":"gpt-4o"}"#).as_deref(), Some("gpt-4o"));
        // Escaped, it is what the upstream reads: the parser undoes the escapes.
        assert_eq!(
            model(br#"{"model":"gpt\u002d4o"}"#).as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(model(br#"{"model":"a\"b"}"#).as_deref(), Some("a\"b"));
        // Anything but a string is no model.
        for body in [
            &br#"{"model":null}"#[..],
            br#"{"model":4}"#,
            br#"{"other":1}"#,
        ] {
            assert_eq!(
                prepare_request(Bytes::from_static(body), true)
                    .unwrap()
                    .model,
                None
            );
        }
        // Not asked for: not read.
        let p = prepare_request(Bytes::from_static(br#"{"model":"m"}"#), false).unwrap();
        assert_eq!(p.model, None);
    }

    #[test]
    fn the_estimate_is_the_body_plus_the_output_cap_times_the_choices() {
        let cap = |body: &'static [u8]| prepare_request(Bytes::from_static(body), false).unwrap();
        let p = cap(br#"{"max_tokens":100,"n":3}"#);
        assert_eq!(
            p.output,
            OutputCap {
                cap: Some(100),
                choices: 3
            }
        );
        assert_eq!(estimate(24, p.output, 4096).total(), 24 + 300);
        // max_completion_tokens wins over the deprecated max_tokens; none: the default.
        let p = cap(br#"{"max_tokens":100,"max_completion_tokens":7}"#);
        assert_eq!(p.output.tokens(4096), 7);
        assert_eq!(cap(br#"{"model":"m"}"#).output.tokens(4096), 4096);
        // Not a non-negative integer: as absent.
        assert_eq!(cap(br#"{"max_tokens":-1}"#).output.tokens(50), 50);
        assert_eq!(cap(br#"{"max_tokens":"9"}"#).output.tokens(50), 50);
        // The legacy API's best_of generates that many.
        assert_eq!(
            cap(br#"{"max_tokens":10,"n":2,"best_of":5}"#)
                .output
                .tokens(1),
            50
        );
        let r = check_responses_request(br#"{"max_output_tokens":64}"#, false)
            .unwrap()
            .0;
        assert_eq!(r.tokens(4096), 64);
    }

    #[test]
    fn an_estimate_that_cannot_fit_says_what_to_lower_counting_the_choices() {
        let limit = "org token limit of 1000 tokens per 60s";
        let of = |body: &'static [u8], len: usize, default: u64| {
            let p = prepare_request(Bytes::from_static(body), false).unwrap();
            estimate(len, p.output, default).cannot_fit(limit, 1000)
        };
        // One choice: the cap is what the prompt leaves.
        let m = of(br#"{"max_tokens":5000}"#, 100, 4096);
        assert!(m.contains(limit), "{m}");
        assert!(m.contains("reserves up to 5100 tokens"), "{m}");
        assert!(m.contains("to at most 900."), "{m}");
        assert!(!m.contains("`n`"), "{m}");
        // Three choices: each reserves the cap, so a third of what the prompt leaves fits.
        let m = of(br#"{"max_tokens":500,"n":3}"#, 100, 4096);
        assert!(m.contains("reserves up to 1600 tokens"), "{m}");
        assert!(m.contains("500 for each of its 3 choices"), "{m}");
        assert!(m.contains("to at most 300, or lower `n`."), "{m}");
        // No cap named: the default is per choice, and said so.
        let m = of(br#"{"n":2}"#, 100, 2000);
        assert!(m.contains("to at most 450, or lower `n`"), "{m}");
        assert!(
            m.contains("default of 2000 is assumed for each choice"),
            "{m}"
        );
        let m = of(br#"{}"#, 100, 2000);
        assert!(m.contains("to at most 900: "), "{m}");
        assert!(m.contains("default of 2000 is assumed."), "{m}");
        // More choices than tokens left: only fewer choices can fit.
        let m = of(br#"{"max_tokens":10,"n":50}"#, 980, 4096);
        assert!(m.contains("lower `n` to at most 20"), "{m}");
        // A prompt alone at the limit: only a shorter one.
        let m = of(br#"{"max_tokens":1}"#, 1000, 4096);
        assert!(m.ends_with("To fit, send a shorter prompt."), "{m}");
    }

    #[test]
    fn stream_requests_ask_for_usage() {
        let ask = |body: &'static [u8]| {
            prepare_request(Bytes::from_static(body), false).map(|p| (p.body, p.stream))
        };
        let (b, s) = ask(br#"{"stream":true,"model":"m"}"#).unwrap();
        assert_eq!(
            s,
            Some(StreamRequest {
                caller_wants_usage: false
            })
        );
        assert_eq!(
            &b[..],
            br#"{"stream":true,"model":"m","stream_options":{"include_usage":true}}"#
        );
        let (b, s) =
            ask(br#"{"stream": true, "stream_options": {"include_usage": true}}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(
            s,
            Some(StreamRequest {
                caller_wants_usage: true
            })
        );
        // Spaces and key escapes stay as they came; the member goes before the brace.
        let (b, _) = ask(b"{ \"str\\u0065am\" : true }\n").unwrap();
        assert_eq!(
            &b[..],
            &b"{ \"str\\u0065am\" : true ,\"stream_options\":{\"include_usage\":true}}"[..]
        );
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        // Other options stay; a non-object is replaced.
        let (b, _) =
            ask(br#"{"stream_options":{"x":1,"include_usage":false},"stream":true}"#).unwrap();
        assert_eq!(
            &b[..],
            br#"{"stream":true,"stream_options":{"include_usage":true,"x":1}}"#
        );
        // Even one that no f64 holds: still JSON, and the caller still asked for usage.
        let (b, s) =
            ask(br#"{"stream":true,"stream_options":{"include_usage":true,"x":1e400}}"#).unwrap();
        assert_eq!(
            &b[..],
            br#"{"stream":true,"stream_options":{"include_usage":true,"x":1e400}}"#
        );
        assert_eq!(
            s,
            Some(StreamRequest {
                caller_wants_usage: true
            })
        );
        let (b, _) = ask(br#"{"stream":true,"stream_options":3}"#).unwrap();
        assert_eq!(
            &b[..],
            br#"{"stream":true,"stream_options":{"include_usage":true}}"#
        );
        // Not streaming: forwarded as it came.
        for body in [
            &br#"{"model":"m"}"#[..],
            b"{\"stream\":false}",
            b"{\"stream\" : null}",
        ] {
            let p = prepare_request(Bytes::copy_from_slice(body), false).unwrap();
            let (b, s) = (p.body, p.stream);
            assert_eq!((&b[..], s), (body, None));
        }
        // Whether the upstream streams would be its guess: refused.
        for body in [
            &b"[1]"[..],
            b"not json",
            b"\xef\xbb\xbf{\"stream\":true}",
            b"{\"stream\":true,\"x\":NaN}",
            b"",
            b"{\"stream\":1}",
            b"{\"stream\":\"true\"}",
        ] {
            assert!(prepare_request(Bytes::copy_from_slice(body), false).is_err());
        }
        // A body of more members than any request has, or options too long to take apart:
        // refused, saying why.
        let many = format!("{{{}\"stream\":true}}", "\"a\":0,".repeat(MAX_FIELDS));
        assert_eq!(
            prepare_request(Bytes::from(many), false).map(|_| ()),
            Err(TOO_MANY_FIELDS.to_owned())
        );
        let long = format!(
            "{{\"stream\":true,\"stream_options\":{{\"x\":\"{}\"}}}}",
            "y".repeat(MAX_STREAM_OPTIONS)
        );
        assert!(prepare_request(Bytes::from(long), false).is_err());
        // Which `stream` counts depends on the server's parser: refused.
        assert!(ask(br#"{"stream":false,"stream":true}"#).is_err());
        assert!(ask(br#"{"stream":true,"stream_options":{},"stream_options":{}}"#).is_err());
    }

    #[test]
    fn a_field_a_case_blind_server_reads_differently_is_refused() {
        // Go's encoding/json streams on any of these; the gateway would not have asked for
        // usage.
        for body in [
            &br#"{"Stream":true}"#[..],
            br#"{"STREAM":false}"#,
            "{\"\u{017F}tream\":true}".as_bytes(),
            br#"{"stream":true,"Stream_Options":{}}"#,
            br#"{"stream":true,"stream":false}"#,
        ] {
            let got = prepare_request(Bytes::copy_from_slice(body), false);
            assert!(got.is_err(), "{}", String::from_utf8_lossy(body));
        }
        // Nor any field the estimate or the price reads.
        for body in [
            &br#"{"Max_Tokens":100000}"#[..],
            br#"{"N":8}"#,
            br#"{"max_tokens":10,"max_tokens":100000}"#,
            "{\"max_output_to\u{212A}ens\":9}".as_bytes(),
        ] {
            let got = prepare_request(Bytes::copy_from_slice(body), false);
            assert!(got.is_err(), "{}", String::from_utf8_lossy(body));
            assert!(check_responses_request(body, true).is_err());
        }
        let bg = "{\"bac\u{212A}ground\":true}";
        assert!(check_responses_request(bg.as_bytes(), true).is_err());
        // Not a fold of `stream`: other fields pass.
        assert!(
            prepare_request(Bytes::from_static(br#"{"streams":true,"strea":1}"#), false).is_ok()
        );
        // Inside the options, every spelling of include_usage gives way to the one set.
        let p = prepare_request(
            Bytes::from_static(br#"{"stream":true,"stream_options":{"Include_Usage":true,"x":1}}"#),
            false,
        )
        .unwrap();
        assert_eq!(
            &p.body[..],
            br#"{"stream":true,"stream_options":{"include_usage":true,"x":1}}"#
        );
        assert_eq!(
            p.stream,
            Some(StreamRequest {
                caller_wants_usage: true
            })
        );
    }
}
