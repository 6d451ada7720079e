//! Plain chat deltas: which `chat.completion.chunk` events continue the open output item, and
//! the Responses event each one becomes.
//!
//! Almost every event of a chat-completions stream carries one more piece of the item already
//! being streamed: a token of message text, of reasoning, or of a tool call's arguments. Such an
//! event changes nothing but that item, so a consumer that knows which item is open can take it
//! without the general chunk decoder and assembler. [`plain_delta`] says whether one event's
//! JSON is such a *plain* delta and returns its piece; anything else (usage, a finish reason, an
//! error, several pieces, a new tool call, an unexpected type) is `None`, and the caller hands the
//! event to its general path, which handles it (and reports it) exactly as before. Refusing is
//! always safe; accepting is only for shapes the general path reads the same way.
//!
//! The JSON is read with typed visitors that borrow the input and check the rules as they go:
//! a known key twice in its object, a lone surrogate or a number beyond the f64 range anywhere,
//! or nesting deeper than 127 levels is a refusal, and `-0` reads as a float (no integer index).
//! Whatever this accepts, msgspec's typed decoder (the general path) reads with the same values.
//!
//! [`delta_event`] writes one delta event's JSON, byte for byte what msgspec writes for the
//! event's dict (the Cython `encode_delta` and its pure twin write the same).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One plain delta's piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plain {
    /// A chunk that changes nothing (no choices, no delta, or empty strings).
    Nothing,
    /// `choices[0].delta.content`: message text.
    Text(String),
    /// `choices[0].delta.reasoning` (or `reasoning_content` when that is empty): reasoning text.
    Reasoning(String),
    /// `choices[0].delta.tool_calls[0]`: more arguments (possibly empty) of the call at `index`.
    Arguments { index: i64, arguments: String },
}

// -- reading: typed, borrowing, refusing early ------------------------------------------------
//
// Every rule is checked while reading: a value the rules refuse is a deserialisation error, and
// an error is a refusal. Known keys may appear once in their object; every other value is read
// through (`Skip`), so its strings and numbers are validated as in a generic value, and dropped.

/// Any JSON value, validated and dropped.
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SkipVisitor).map(|()| Skip)
    }
}

struct SkipVisitor;

impl<'de> Visitor<'de> for SkipVisitor {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        if v.is_finite() {
            Ok(())
        } else {
            Err(E::custom("not a finite number"))
        }
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value::<Skip>()?;
        }
        Ok(())
    }
}

/// A string, borrowed from the input when it has no escapes (`""` for null when `NULL`).
struct StrVisitor<const NULL: bool>;

impl<'de, const NULL: bool> Visitor<'de> for StrVisitor<NULL> {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(if NULL { "null or a string" } else { "a string" })
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        if NULL {
            Ok(Cow::Borrowed(""))
        } else {
            Err(E::custom("null"))
        }
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

/// An object key.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(StrVisitor::<false>).map(Key)
    }
}

/// null or a string (`""` for null).
struct OptStr<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for OptStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrVisitor::<true>).map(OptStr)
    }
}

/// null only.
struct Null;

impl<'de> Deserialize<'de> for Null {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("null")
            }
            fn visit_unit<E>(self) -> Result<(), E> {
                Ok(())
            }
        }
        d.deserialize_any(V).map(|()| Null)
    }
}

/// A JSON integer that fits in i64 (a float, `-0` included, is refused).
struct Int(i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = i64;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E>(self, v: i64) -> Result<i64, E> {
                Ok(v)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
                i64::try_from(v).map_err(|_| E::custom("integer out of range"))
            }
        }
        d.deserialize_any(V).map(Int)
    }
}

/// null, or a `T` (`None` for null).
struct Opt<T>(Option<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Opt<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Option::<T>::deserialize(d).map(Opt)
    }
}

/// An array of at most one `T` (a longer one is refused).
struct One<T>(Option<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for One<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Option<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of at most one element")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<T>()?;
                if first.is_some() && seq.next_element::<Skip>()?.is_some() {
                    return Err(de::Error::custom("more than one element"));
                }
                Ok(first)
            }
        }
        d.deserialize_seq(V(PhantomData)).map(One)
    }
}

/// Reads the object `map`: `field(map, key)` reads the value of a known key and returns its
/// number (below 32), or returns None and the value is skipped. A known key seen twice is
/// refused.
fn object<'de, A, F>(mut map: A, mut field: F) -> Result<(), A::Error>
where
    A: MapAccess<'de>,
    F: FnMut(&mut A, &str) -> Result<Option<u32>, A::Error>,
{
    let mut seen = 0u32;
    while let Some(Key(key)) = map.next_key()? {
        match field(&mut map, &key)? {
            Some(bit) => {
                if seen & (1 << bit) != 0 {
                    return Err(de::Error::custom("duplicate key"));
                }
                seen |= 1 << bit;
            }
            None => {
                map.next_value::<Skip>()?;
            }
        }
    }
    Ok(())
}

/// An object type read with [`object`]: `$fields` maps each known key to (its number, the
/// statement that reads its value into `$out` from `$m`).
macro_rules! object_type {
    ($ty:ident, $what:literal, |$out:ident, $m:ident| { $($key:literal => $bit:literal $read:block)* }) => {
        impl<'de> Deserialize<'de> for $ty<'de> {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> Visitor<'de> for V {
                    type Value = $ty<'de>;
                    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                        f.write_str($what)
                    }
                    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                        let mut $out = $ty::default();
                        object(map, |$m, key| {
                            Ok(match key {
                                $($key => {
                                    $read
                                    Some($bit)
                                })*
                                _ => None,
                            })
                        })?;
                        Ok($out)
                    }
                }
                d.deserialize_map(V)
            }
        }
    };
}

#[derive(Default)]
struct Function<'de> {
    arguments: Cow<'de, str>,
}

object_type!(Function, "a function object", |out, m| {
    "name" => 0 { m.next_value::<OptStr>()?; }
    "arguments" => 1 { out.arguments = m.next_value::<OptStr>()?.0; }
});

#[derive(Default)]
struct ToolCall<'de> {
    index: Option<i64>,
    id: Cow<'de, str>,
    arguments: Cow<'de, str>,
}

object_type!(ToolCall, "a tool call object", |out, m| {
    "index" => 0 { out.index = Some(m.next_value::<Int>()?.0); }
    "id" => 1 { out.id = m.next_value::<OptStr>()?.0; }
    "function" => 2 {
        if let Opt(Some(f)) = m.next_value::<Opt<Function>>()? {
            out.arguments = f.arguments;
        }
    }
});

#[derive(Default)]
struct Delta<'de> {
    content: Cow<'de, str>,
    reasoning: Cow<'de, str>,
    reasoning_content: Cow<'de, str>,
    refusal: bool,
    call: Option<ToolCall<'de>>,
}

object_type!(Delta, "a delta object", |out, m| {
    "content" => 0 { out.content = m.next_value::<OptStr>()?.0; }
    "reasoning" => 1 { out.reasoning = m.next_value::<OptStr>()?.0; }
    "reasoning_content" => 2 { out.reasoning_content = m.next_value::<OptStr>()?.0; }
    "refusal" => 3 { out.refusal = !m.next_value::<OptStr>()?.0.is_empty(); }
    "tool_calls" => 4 {
        if let Opt(Some(One(call))) = m.next_value::<Opt<One<ToolCall>>>()? {
            out.call = call;
        }
    }
});

#[derive(Default)]
struct Choice<'de> {
    delta: Option<Delta<'de>>,
}

object_type!(Choice, "a choice object", |out, m| {
    "index" => 0 {
        if m.next_value::<Int>()?.0 != 0 {
            return Err(de::Error::custom("not the first choice"));
        }
    }
    "finish_reason" => 1 { m.next_value::<Null>()?; }
    "delta" => 2 { out.delta = m.next_value::<Opt<Delta>>()?.0; }
});

#[derive(Default)]
struct Top<'de> {
    choice: Option<Choice<'de>>,
}

object_type!(Top, "a chunk object", |out, m| {
    "error" => 0 { m.next_value::<Null>()?; }
    "usage" => 1 { m.next_value::<Null>()?; }
    "status_code" => 2 { m.next_value::<Null>()?; }
    "choices" => 3 { out.choice = m.next_value::<One<Choice>>()?.0; }
});

/// The plain delta of one SSE event's data, or `None` when the general path must handle it.
///
/// Plain means: a JSON object whose `error`, `usage` and `status_code` are absent or null, whose
/// `choices` is absent or an array of at most one choice; that choice is an object with `index`
/// absent or the integer 0, `finish_reason` absent or null, and `delta` absent, null, or an object
/// whose `content`, `reasoning`, `reasoning_content` and `refusal` are absent, null or strings
/// (`refusal` empty), whose `tool_calls` is absent, null or an array of at most one element, and
/// which carries at most one non-empty piece: content, reasoning (`reasoning`, else
/// `reasoning_content`), or one tool call whose `index` is an integer, `id` absent, null or
/// empty, and `function` absent, null, or an object whose `name` and `arguments` are absent, null
/// or strings. Other keys are ignored, but their values must be valid (no lone surrogate, no
/// number beyond the f64 range); none of the keys above may appear twice in its object; nesting
/// is limited to 127 levels.
pub fn plain_delta(data: &str) -> Option<Plain> {
    let top: Top = serde_json::from_str(data).ok()?;
    let Some(choice) = top.choice else {
        return Some(Plain::Nothing);
    };
    let Some(delta) = choice.delta else {
        return Some(Plain::Nothing);
    };
    if delta.refusal {
        return None;
    }
    let reasoning = if delta.reasoning.is_empty() {
        delta.reasoning_content
    } else {
        delta.reasoning
    };
    match (delta.content.is_empty(), reasoning.is_empty(), delta.call) {
        (true, true, None) => Some(Plain::Nothing),
        (false, true, None) => Some(Plain::Text(delta.content.into_owned())),
        (true, false, None) => Some(Plain::Reasoning(reasoning.into_owned())),
        (true, true, Some(call)) if call.id.is_empty() => Some(Plain::Arguments {
            index: call.index?,
            arguments: call.arguments.into_owned(),
        }),
        _ => None,
    }
}

// -- writing ----------------------------------------------------------------------------------

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Append `s` as a quoted JSON string, escaping as msgspec does: `\"`, `\\`, `\b`, `\f`, `\n`,
/// `\r`, `\t`, other characters below U+0020 as `\u00XX`; everything else as UTF-8.
pub fn json_str(out: &mut Vec<u8>, s: &str) {
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &c) in bytes.iter().enumerate() {
        let short = match c {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            0..=0x1f => 0,
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if short != 0 {
            out.extend_from_slice(&[b'\\', short]);
        } else {
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(c >> 4) as usize],
                HEX[(c & 15) as usize],
            ]);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

fn json_int(out: &mut Vec<u8>, v: i64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    let mut u = v.unsigned_abs();
    loop {
        i -= 1;
        buf[i] = b'0' + (u % 10) as u8;
        u /= 10;
        if u == 0 {
            break;
        }
    }
    if v < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&buf[i..]);
}

/// The part index a delta event carries after `output_index`: a content part's
/// (`content_index`: message text, reasoning text) or a reasoning summary part's
/// (`summary_index`: `response.reasoning_summary_text.delta`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartIndex {
    Content,
    Summary,
}

impl PartIndex {
    fn key(self) -> &'static [u8] {
        match self {
            PartIndex::Content => b",\"content_index\":",
            PartIndex::Summary => b",\"summary_index\":",
        }
    }
}

/// One delta event's JSON: `type`, `sequence_number`, `item_id`, `output_index`, then
/// `content_index` when it is not negative, `delta`, and `"logprobs":[]` when asked for.
#[allow(clippy::too_many_arguments)]
pub fn delta_event(
    out: &mut Vec<u8>,
    event_type: &str,
    sequence_number: i64,
    item_id: &str,
    output_index: i64,
    content_index: i64,
    delta: &str,
    logprobs: bool,
) {
    part_delta_event(
        out,
        event_type,
        sequence_number,
        item_id,
        output_index,
        PartIndex::Content,
        content_index,
        delta,
        logprobs,
    );
}

/// [`delta_event`] with the part index named by `part`: `summary_index` in place of
/// `content_index` for [`PartIndex::Summary`] (in the same place, and likewise left out when
/// `index` is negative).
#[allow(clippy::too_many_arguments)]
pub fn part_delta_event(
    out: &mut Vec<u8>,
    event_type: &str,
    sequence_number: i64,
    item_id: &str,
    output_index: i64,
    part: PartIndex,
    index: i64,
    delta: &str,
    logprobs: bool,
) {
    out.extend_from_slice(b"{\"type\":");
    json_str(out, event_type);
    out.extend_from_slice(b",\"sequence_number\":");
    json_int(out, sequence_number);
    out.extend_from_slice(b",\"item_id\":");
    json_str(out, item_id);
    out.extend_from_slice(b",\"output_index\":");
    json_int(out, output_index);
    if index >= 0 {
        out.extend_from_slice(part.key());
        json_int(out, index);
    }
    out.extend_from_slice(b",\"delta\":");
    json_str(out, delta);
    out.extend_from_slice(if logprobs { b",\"logprobs\":[]}" } else { b"}" });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(index: i64, a: &str) -> Option<Plain> {
        Some(Plain::Arguments {
            index,
            arguments: a.to_owned(),
        })
    }

    #[test]
    fn plain_shapes() {
        let text = r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],"usage":null}"#;
        assert_eq!(plain_delta(text), Some(Plain::Text("hi".into())));
        let call = r#"{"choices":[{"delta":{"tool_calls":[{"index":2,"function":{"arguments":"{\"a"}}]}}]}"#;
        assert_eq!(plain_delta(call), args(2, "{\"a"));
        let named = r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"","type":"function","function":{"name":"f","arguments":"x"}}]}}]}"#;
        assert_eq!(plain_delta(named), args(0, "x"));
        assert_eq!(
            plain_delta(r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#),
            args(0, "")
        );
        assert_eq!(
            plain_delta(r#"{"choices":[{"delta":{"reasoning":"","reasoning_content":"r"}}]}"#),
            Some(Plain::Reasoning("r".into()))
        );
        assert_eq!(
            plain_delta(r#"{"choices":[{"delta":{"reasoning":"a","reasoning_content":"b"}}]}"#),
            Some(Plain::Reasoning("a".into()))
        );
        assert_eq!(
            plain_delta(r#"{"choices":[{"delta":{"content":"\u00e9\n"}}]}"#),
            Some(Plain::Text("é\n".into()))
        );
        for nothing in [
            r#"{}"#,
            r#"{"choices":[]}"#,
            r#"{"choices":[{"index":0}]}"#,
            r#"{"choices":[{"delta":null}]}"#,
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":null,"content":null}}],"usage":null}"#,
            // other keys may repeat (msgspec ignores them too), and their values are only checked
            r#"{"x":1,"choices":[],"x":{"y":2,"y":3}}"#,
            r#"{"x":"\ud83d\ude00","choices":[]}"#,
        ] {
            assert_eq!(plain_delta(nothing), Some(Plain::Nothing), "{nothing}");
        }
    }

    #[test]
    fn refused_shapes() {
        for refused in [
            "",
            "[DONE]",
            "[]",
            r#"{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":1}}"#,
            r#"{"choices":[{"delta":{"content":"a"}}],"error":{"message":"x"}}"#,
            r#"{"choices":[{"delta":{"content":"a"}}],"status_code":500}"#,
            r#"{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"delta":{"content":"a"},"finish_reason":""}]}"#,
            r#"{"choices":[{"index":1,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0.0,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":-0,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":true,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":null,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"delta":{"content":"a"}},{"index":1,"delta":{}}]}"#,
            r#"{"choices":null}"#,
            r#"{"choices":[{"delta":{"content":1}}]}"#,
            r#"{"choices":[{"delta":{"content":"a","reasoning":"b"}}]}"#,
            r#"{"choices":[{"delta":{"content":"a","refusal":"no"}}]}"#,
            r#"{"choices":[{"delta":{"refusal":"no"}}]}"#,
            r#"{"choices":[{"delta":{"reasoning":5}}]}"#,
            r#"{"choices":[{"delta":{"content":"a","tool_calls":[{"index":0}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0},{"index":1}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"x"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"arguments":"x"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":5}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":"f"}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":9223372036854775808}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":{"index":0}}}]}"#,
            r#"{"choices":[{"delta":"x"}]}"#,
            r#"{"choices":[{"delta":{"content":"\ud800"}}]}"#,
            r#"{"choices":[],"x":"\udc00"}"#,
            r#"{"choices":[],"x":1e999}"#,
            r#"{"choices":[],"x":NaN}"#,
            r#"{"choices":[]} x"#,
            // a known key twice is refused (msgspec would check the first value too)
            r#"{"choices":[{"delta":{"content":5,"content":"b"}}]}"#,
            r#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[],"choices":[]}"#,
        ] {
            assert_eq!(plain_delta(refused), None, "{refused}");
        }
    }

    #[test]
    fn nesting_limit() {
        let ok = format!(r#"{{"x":{}{}}}"#, "[".repeat(126), "]".repeat(126));
        assert_eq!(plain_delta(&ok), Some(Plain::Nothing));
        let deep = format!(r#"{{"x":{}{}}}"#, "[".repeat(127), "]".repeat(127));
        assert_eq!(plain_delta(&deep), None);
    }

    #[test]
    fn delta_events() {
        let mut out = Vec::new();
        delta_event(
            &mut out,
            "response.output_text.delta",
            7,
            "msg_1",
            0,
            0,
            "a\"\\\n\u{1}\u{7f}é😀",
            true,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"type\":\"response.output_text.delta\",\"sequence_number\":7,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"a\\\"\\\\\\n\\u0001\u{7f}é😀\",\"logprobs\":[]}"
        );
        let mut out = Vec::new();
        delta_event(
            &mut out,
            "response.function_call_arguments.delta",
            i64::MIN,
            "fc",
            2,
            -1,
            "",
            false,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"type\":\"response.function_call_arguments.delta\",\"sequence_number\":-9223372036854775808,\"item_id\":\"fc\",\"output_index\":2,\"delta\":\"\"}"
        );
    }

    /// [`part_delta_event`]'s JSON, as a string.
    fn summary_event(seq: i64, item_id: &str, index: i64, delta: &str, logprobs: bool) -> String {
        let mut out = Vec::new();
        let ty = "response.reasoning_summary_text.delta";
        part_delta_event(
            &mut out,
            ty,
            seq,
            item_id,
            3,
            PartIndex::Summary,
            index,
            delta,
            logprobs,
        );
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn summary_delta_events() {
        // what hotloop.protocol.events.summary_delta writes: summary_index where content_index is
        assert_eq!(
            summary_event(12, "rs_\u{e9}", 0, "a\"\\\n\u{1}\u{2028}😀", false),
            "{\"type\":\"response.reasoning_summary_text.delta\",\"sequence_number\":12,\"item_id\":\"rs_\u{e9}\",\"output_index\":3,\"summary_index\":0,\"delta\":\"a\\\"\\\\\\n\\u0001\u{2028}😀\"}"
        );
        assert!(summary_event(0, "i", 4, "x", true)
            .ends_with(",\"output_index\":3,\"summary_index\":4,\"delta\":\"x\",\"logprobs\":[]}"));
        // a negative index is left out, as a content index is
        assert!(
            summary_event(0, "i", -1, "x", false).ends_with(",\"output_index\":3,\"delta\":\"x\"}")
        );
        // the content index, through either function, is the same bytes
        let (mut a, mut b) = (Vec::new(), Vec::new());
        part_delta_event(&mut a, "t", 5, "i", 1, PartIndex::Content, 2, "x", true);
        delta_event(&mut b, "t", 5, "i", 1, 2, "x", true);
        assert_eq!(a, b);
        assert!(String::from_utf8(a)
            .unwrap()
            .contains(",\"content_index\":2,"));
    }
}
