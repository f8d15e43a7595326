//! WebSocket frames (RFC 6455, 5) of a Realtime session, read as they pass without holding what
//! the meter does not need, and written (a close frame, the demo's server frames).

/// Largest text message held to read its `type` and usage. A larger one (a `response.done`
/// carrying a very long output) passes unmetered, with a warning. Audio travels in messages of
/// a few tens of KiB; a turn's whole text output rarely approaches this. Messages that are not
/// metered events are never held, whatever their length.
pub const MAX_METERED_MESSAGE: usize = 1024 * 1024;

/// The payload of a close frame with status 1001 (going away).
pub const GOING_AWAY: [u8; 2] = 1001u16.to_be_bytes();

/// A frame of `opcode` carrying `payload` (the last of its message when `fin`): unmasked as a
/// server sends it or, with `mask`, masked as a client must (RFC 6455, 5.2 and 5.3).
pub fn frame(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = vec![(u8::from(fin) << 7) | opcode];
    let m = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => out.push(m | n as u8),
        n if n <= 0xffff => {
            out.push(m | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(m | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        None => out.extend_from_slice(payload),
        Some(k) => {
            out.extend_from_slice(&k);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
        }
    }
    out
}

/// What [`FrameReader`] reports.
#[derive(Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// A whole text message (its fragments joined, unmasked).
    Text(&'a [u8]),
    /// A text message that may be metered, longer than [`MAX_METERED_MESSAGE`]: not held, not
    /// reported.
    TooLarge {
        /// `true`: its `type` is one the meter reads; `false`: its type could not be told from
        /// its first bytes.
        metered: bool,
    },
    /// A text message compressed by an extension (`RSV1` set): it cannot be read.
    Compressed,
}

/// Reads the WebSocket frames (RFC 6455, 5) of one direction of a session from the bytes as they
/// come, in pieces of any size, and reports each text message that may be a metered server event
/// (`response.done`, `session.created`, `session.updated`, told by its first bytes; one whose
/// type they cannot tell is reported too). Fragmented messages are joined, control frames
/// between their fragments skipped, 16- and 64-bit lengths read and masked frames unmasked;
/// other text messages, binary messages and control frames are skipped without being held. At
/// most [`MAX_METERED_MESSAGE`] bytes of a message are held.
#[derive(Debug, Default)]
pub struct FrameReader {
    /// Follows frames without holding any message (`false`: text messages are reported).
    pub skip_text: bool,
    /// The frame header read so far (at most 14 bytes).
    head: [u8; 14],
    head_len: usize,
    /// Within a frame's payload: the bytes still to come.
    payload_left: u64,
    in_payload: bool,
    /// Position in the payload (for the mask).
    payload_pos: u64,
    mask: Option<[u8; 4]>,
    fin: bool,
    control: bool,
    state: MessageState,
    /// What the held message's first bytes say of its type.
    kind: Kind,
    text: Vec<u8>,
    /// When the first close frame began: nothing but its end may follow it (RFC 6455, 5.5.1).
    closed_at: Option<std::time::Instant>,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum MessageState {
    /// Between messages.
    #[default]
    Idle,
    /// A text message being held.
    Collect,
    /// A message not held (binary, too large, compressed, or a stray continuation).
    Skip,
}

/// How many bytes of a text message are read to tell its `type`: room for it after short
/// members such as `event_id`. A message that has not told by then is held whole and parsed.
const TYPE_WITHIN: usize = 256;

/// The server events the meter reads, by their `type`.
const METERED_TYPES: [&[u8]; 3] = [b"response.done", b"session.created", b"session.updated"];

/// What the first bytes of a text message say about its `type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    /// More bytes are needed.
    #[default]
    Undecided,
    /// A JSON object whose `type` is one the meter reads.
    Metered(&'static [u8]),
    /// Anything else: an object of another type, or not a JSON object at all.
    Other,
    /// Cannot be told from the first bytes (`type` after a nested value, or escaped).
    Unknown,
}

/// What `prefix`, the first bytes of a text message, says of its JSON `type`. Server events come
/// with `type` first (OpenAI's do); members before it with a string, number or literal value,
/// and whitespace anywhere, are passed over.
fn kind_of(prefix: &[u8]) -> Kind {
    let p = prefix;
    let skip_ws = |i: usize| {
        i + p[i..]
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count()
    };
    let mut i = skip_ws(0);
    match p.get(i) {
        None => return Kind::Undecided,
        Some(b'{') => i += 1,
        Some(_) => return Kind::Other,
    }
    loop {
        i = skip_ws(i);
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b'"') => {}
            // `}`: an object without a `type`; anything else is not JSON.
            Some(_) => return Kind::Other,
        }
        let Some((name, escaped, end)) = json_string(p, i) else {
            return Kind::Undecided;
        };
        if escaped {
            return Kind::Unknown;
        }
        i = skip_ws(end);
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b':') => i = skip_ws(i + 1),
            Some(_) => return Kind::Other,
        }
        if name == b"type" {
            if p.get(i).is_some_and(|&b| b != b'"') {
                return Kind::Other;
            }
            return match json_string(p, i) {
                Some((_, true, _)) => Kind::Unknown,
                Some((value, false, _)) => METERED_TYPES
                    .into_iter()
                    .find(|&t| t == value)
                    .map_or(Kind::Other, Kind::Metered),
                // A type cut short: another type if no metered one starts so.
                None => {
                    let partial = p.get(i + 1..).unwrap_or_default();
                    let may_be = partial.contains(&b'\\')
                        || METERED_TYPES.iter().any(|t| t.starts_with(partial));
                    if may_be { Kind::Undecided } else { Kind::Other }
                }
            };
        }
        // Another member: its value passed over, if it is no object or array.
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b'{' | b'[') => return Kind::Unknown,
            Some(b'"') => match json_string(p, i) {
                Some((_, _, end)) => i = end,
                None => return Kind::Undecided,
            },
            Some(_) => {
                i += p[i..]
                    .iter()
                    .take_while(|&&b| b != b',' && b != b'}' && !b.is_ascii_whitespace())
                    .count();
            }
        }
        i = skip_ws(i);
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b',') => i += 1,
            Some(_) => return Kind::Other,
        }
    }
}

/// The JSON string that starts (with its quote) at `at` of `p`: its raw contents, whether they
/// hold an escape, and where it ends; `None` if `p` ends first.
fn json_string(p: &[u8], at: usize) -> Option<(&[u8], bool, usize)> {
    let mut escaped = false;
    let mut i = at + 1;
    while i < p.len() {
        match p[i] {
            b'\\' => {
                escaped = true;
                i += 2;
            }
            b'"' => return Some((&p[at + 1..i], escaped, i + 1)),
            _ => i += 1,
        }
    }
    None
}

/// The length of a frame header that starts with `head` (at least 2 bytes).
fn header_len(head: &[u8]) -> usize {
    let ext = match head[1] & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let mask = if head[1] & 0x80 != 0 { 4 } else { 0 };
    2 + ext + mask
}

impl FrameReader {
    /// A reader at the start of a stream; with `skip_text`, frames are followed without holding
    /// any message.
    pub fn new(skip_text: bool) -> FrameReader {
        FrameReader {
            skip_text,
            ..FrameReader::default()
        }
    }

    /// Reads `data`, the next bytes of the stream, calling `on_message` for each message it
    /// completes.
    pub fn push(&mut self, mut data: &[u8], mut on_message: impl FnMut(Message<'_>)) {
        while !data.is_empty() {
            if !self.in_payload {
                let need = if self.head_len < 2 {
                    2
                } else {
                    header_len(&self.head[..self.head_len])
                };
                let take = (need - self.head_len).min(data.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&data[..take]);
                self.head_len += take;
                data = &data[take..];
                if self.head_len < need {
                    continue;
                }
                if need == 2 && header_len(&self.head[..2]) > 2 {
                    continue; // An extended length or a mask follows.
                }
                self.start_frame(&mut on_message);
                if self.payload_left == 0 {
                    self.end_frame(&mut on_message);
                }
                continue;
            }
            let n = usize::try_from(self.payload_left)
                .unwrap_or(usize::MAX)
                .min(data.len());
            let (chunk, rest) = data.split_at(n);
            if !self.control && self.state == MessageState::Collect {
                self.collect(chunk, &mut on_message);
            }
            self.payload_pos += n as u64;
            self.payload_left -= n as u64;
            data = rest;
            if self.payload_left == 0 {
                self.end_frame(&mut on_message);
            }
        }
    }

    /// Whether the bytes read so far end with a whole frame.
    pub fn between_frames(&self) -> bool {
        !self.in_payload && self.head_len == 0
    }

    /// Whether a close frame has been read: its sender sends no frame after it, and no one
    /// may send one in its name (RFC 6455, 5.5.1).
    pub fn closed(&self) -> bool {
        self.closed_at.is_some()
    }

    /// When the first close frame was read, if one was: which side of a session started the
    /// closing handshake.
    pub fn closed_at(&self) -> Option<std::time::Instant> {
        self.closed_at
    }

    /// The header is complete: reads it and starts the frame's payload.
    fn start_frame(&mut self, on_message: &mut impl FnMut(Message<'_>)) {
        let head = &self.head[..self.head_len];
        let fin = head[0] & 0x80 != 0;
        let compressed = head[0] & 0x40 != 0;
        let opcode = head[0] & 0x0f;
        let (len, at) = match head[1] & 0x7f {
            126 => (u64::from(u16::from_be_bytes([head[2], head[3]])), 4),
            127 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&head[2..10]);
                (u64::from_be_bytes(b), 10)
            }
            n => (u64::from(n), 2),
        };
        self.mask =
            (head[1] & 0x80 != 0).then(|| [head[at], head[at + 1], head[at + 2], head[at + 3]]);
        self.head_len = 0;
        self.in_payload = true;
        self.payload_left = len;
        self.payload_pos = 0;
        self.fin = fin;
        self.control = opcode & 0x08 != 0;
        if opcode == 0x8 && self.closed_at.is_none() {
            self.closed_at = Some(std::time::Instant::now());
        }
        match opcode {
            // Control frames (close, ping, pong) may come between a message's fragments: they
            // leave the message as it is.
            _ if self.control => {}
            // A continuation: the message goes on as it was (a stray one is skipped).
            0 => {
                if self.state == MessageState::Idle {
                    self.state = MessageState::Skip;
                }
            }
            1 if compressed => {
                self.text.clear();
                self.state = MessageState::Skip;
                on_message(Message::Compressed);
            }
            1 if !self.skip_text => {
                self.text.clear();
                self.state = MessageState::Collect;
                self.kind = Kind::Undecided;
            }
            _ => {
                self.text.clear();
                self.state = MessageState::Skip;
            }
        }
    }

    /// Holds `chunk`, the next payload bytes of the text message being read, as long as the
    /// message may be one the meter reads: its first bytes tell ([`kind_of`]), and a message of
    /// another type is dropped then, whatever its length.
    fn collect(&mut self, chunk: &[u8], on_message: &mut impl FnMut(Message<'_>)) {
        let mut rest = chunk;
        let mut pos = self.payload_pos;
        if self.kind == Kind::Undecided {
            let first = rest.len().min(TYPE_WITHIN.saturating_sub(self.text.len()));
            let (head, tail) = rest.split_at(first);
            self.hold(head, pos);
            (rest, pos) = (tail, pos + first as u64);
            self.kind = match kind_of(&self.text) {
                Kind::Undecided if self.text.len() >= TYPE_WITHIN => Kind::Unknown,
                kind => kind,
            };
            match self.kind {
                Kind::Other => {
                    self.state = MessageState::Skip;
                    self.text.clear();
                    return;
                }
                // All of `chunk` is held: the next bytes may tell.
                Kind::Undecided => return,
                Kind::Metered(_) | Kind::Unknown => {}
            }
        }
        if self.text.len() + rest.len() > MAX_METERED_MESSAGE {
            self.state = MessageState::Skip;
            self.text = Vec::new();
            on_message(Message::TooLarge {
                metered: matches!(self.kind, Kind::Metered(_)),
            });
            return;
        }
        self.hold(rest, pos);
    }

    /// Appends `bytes`, payload bytes from position `pos` of the frame, to the message, unmasked.
    fn hold(&mut self, bytes: &[u8], pos: u64) {
        let start = self.text.len();
        self.text.extend_from_slice(bytes);
        if let Some(mask) = self.mask {
            for (i, b) in self.text[start..].iter_mut().enumerate() {
                // Only the position modulo 4 matters.
                let at = (pos as usize).wrapping_add(i);
                *b ^= mask[at % 4];
            }
        }
    }

    /// The frame's payload is complete: a final data frame completes its message.
    fn end_frame(&mut self, on_message: &mut impl FnMut(Message<'_>)) {
        self.in_payload = false;
        if self.control || !self.fin {
            return;
        }
        if self.state == MessageState::Collect {
            on_message(Message::Text(&self.text));
        }
        self.state = MessageState::Idle;
        self.text.clear();
        // A session lives for minutes: the room a large message took is not kept.
        if self.text.capacity() > 64 * 1024 {
            self.text = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a reader reports for `stream` fed in pieces of `piece` bytes.
    fn read(stream: &[u8], piece: usize) -> Vec<String> {
        let mut r = FrameReader::default();
        let mut out = Vec::new();
        for chunk in stream.chunks(piece.max(1)) {
            r.push(chunk, |m| {
                out.push(match m {
                    Message::Text(t) => String::from_utf8_lossy(t).into_owned(),
                    Message::TooLarge { metered: true } => "<too large>".into(),
                    Message::TooLarge { metered: false } => "<too large, type unknown>".into(),
                    Message::Compressed => "<compressed>".into(),
                })
            });
        }
        out
    }

    /// The pieces a session reads its connections in (`realtime`'s copy buffer).
    const COPY_BUFFER: usize = 16 * 1024;

    const DONE: &str = r#"{"type":"response.done","response":{}}"#;
    const CREATED: &str = r#"{ "type" : "session.created", "session": {"model": "m"} }"#;

    #[test]
    fn text_messages_are_read_whatever_the_pieces() {
        let mut s = frame(true, 1, DONE.as_bytes(), None);
        s.extend(frame(true, 2, b"\x00\x01binary", None));
        s.extend(frame(true, 9, b"ping", None));
        s.extend(frame(true, 1, b"", None));
        s.extend(frame(true, 1, b"not json", None));
        s.extend(frame(true, 1, br#"{"type":"response.created"}"#, None));
        s.extend(frame(true, 1, CREATED.as_bytes(), None));
        for piece in [1, 2, 3, 7, 1000] {
            assert_eq!(read(&s, piece), [DONE, "", CREATED], "pieces of {piece}");
        }
    }

    #[test]
    fn the_first_bytes_tell_a_metered_type() {
        let metered = Kind::Metered(b"response.done");
        for (prefix, kind) in [
            (r#"{"type":"response.done""#, metered),
            ("\n { \"type\"\t:\r\n \"response.done\"", metered),
            (
                r#"{"event_id":"e_1","n":-1.5e3,"ok":true,"type":"response.done""#,
                metered,
            ),
            (
                r#"{"type":"session.updated""#,
                Kind::Metered(b"session.updated"),
            ),
            (r#"{"type":"response.done.x""#, Kind::Other),
            (r#"{"type":"conversation.item.cre"#, Kind::Other),
            (r#"{"type":"response.do"#, Kind::Undecided),
            (r#"{"event_id":"e_\"1"#, Kind::Undecided),
            (r#"{"type""#, Kind::Undecided),
            ("", Kind::Undecided),
            ("hello", Kind::Other),
            ("{}", Kind::Other),
            (r#"{"type":7}"#, Kind::Other),
            (
                r#"{"event_id":"e_1","response":{},"type":"response.done"}"#,
                Kind::Unknown,
            ),
            (r#"{"ty\u0070e":"response.done"}"#, Kind::Unknown),
            (r#"{"type":"response\u002edone"}"#, Kind::Unknown),
        ] {
            assert_eq!(kind_of(prefix.as_bytes()), kind, "{prefix}");
        }
    }

    #[test]
    fn a_large_message_of_another_type_is_dropped_at_once_and_never_warned_about() {
        // What a caller can make the upstream echo: over the bound, and not a metered event.
        let echo = format!(
            r#"{{"type":"conversation.item.created","item":{{"text":"{}"}}}}"#,
            "x".repeat(MAX_METERED_MESSAGE)
        );
        let mut r = FrameReader::default();
        let mut seen = Vec::new();
        let f = frame(true, 1, echo.as_bytes(), None);
        for chunk in f.chunks(COPY_BUFFER) {
            r.push(chunk, |m| seen.push(format!("{m:?}")));
            assert!(r.text.len() <= TYPE_WITHIN, "held: {}", r.text.len());
        }
        assert!(seen.is_empty(), "{seen:?}");
        // A metered one as large is warned about; one whose type comes late, once per session.
        let big_done = format!(
            r#"{{"type":"response.done","pad":"{}"}}"#,
            "x".repeat(MAX_METERED_MESSAGE)
        );
        assert_eq!(
            read(&frame(true, 1, big_done.as_bytes(), None), COPY_BUFFER),
            ["<too large>"]
        );
        let late = format!(
            r#"{{"pad":{{"x":"{}"}},"type":"response.done"}}"#,
            "x".repeat(MAX_METERED_MESSAGE)
        );
        assert_eq!(
            read(&frame(true, 1, late.as_bytes(), None), COPY_BUFFER),
            ["<too large, type unknown>"]
        );
    }

    #[test]
    fn fragments_are_joined_around_control_frames() {
        let mut s = frame(false, 1, b"{\"type\":", None);
        s.extend(frame(true, 9, b"ping", None));
        s.extend(frame(false, 0, b"\"response", None));
        s.extend(frame(true, 10, b"", None));
        s.extend(frame(true, 0, b".done\"}", None));
        s.extend(frame(false, 2, b"bin", None));
        s.extend(frame(true, 0, b"ary", None));
        s.extend(frame(true, 1, DONE.as_bytes(), None));
        for piece in [1, 5, 1000] {
            assert_eq!(read(&s, piece), ["{\"type\":\"response.done\"}", DONE]);
        }
    }

    #[test]
    fn long_lengths_and_masks() {
        let padded =
            |c: &str, n: usize| format!(r#"{{"type":"response.done","x":"{}"}}"#, c.repeat(n));
        let (medium, long) = (padded("m", 300), padded("l", 70_000));
        let mut s = frame(true, 1, medium.as_bytes(), None);
        s.extend(frame(true, 1, long.as_bytes(), None));
        // Masked, and the type told across two fragments with their own masks.
        s.extend(frame(false, 1, br#"{"type":"sess"#, Some([1, 2, 3, 4])));
        s.extend(frame(true, 0, br#"ion.created"}"#, Some([9, 8, 7, 6])));
        for piece in [3, 4096, 1 << 20] {
            assert_eq!(
                read(&s, piece),
                [
                    medium.clone(),
                    long.clone(),
                    r#"{"type":"session.created"}"#.into()
                ]
            );
        }
    }

    #[test]
    fn a_message_too_large_is_skipped_and_the_next_is_read() {
        let sized = |len: usize| {
            let head = r#"{"type":"response.done","x":""#;
            format!("{head}{}\"}}", "x".repeat(len - head.len() - 2))
        };
        let big = sized(MAX_METERED_MESSAGE + 1);
        let mut s = frame(false, 1, &big.as_bytes()[..10], None);
        s.extend(frame(true, 0, &big.as_bytes()[10..], None));
        s.extend(frame(true, 1, DONE.as_bytes(), None));
        assert_eq!(read(&s, 64 * 1024), ["<too large>", DONE]);
        let exact = sized(MAX_METERED_MESSAGE);
        assert_eq!(
            read(&frame(true, 1, exact.as_bytes(), None), 1 << 16).len(),
            1
        );
    }

    #[test]
    fn frames_are_followed_without_holding_text() {
        let mut r = FrameReader {
            skip_text: true,
            ..FrameReader::default()
        };
        assert!(r.between_frames());
        let f = frame(true, 1, &[b'x'; 300], Some([1, 2, 3, 4]));
        let mut seen = 0;
        r.push(&f[..1], |_| seen += 1);
        assert!(!r.between_frames(), "within a header");
        r.push(&f[1..100], |_| seen += 1);
        assert!(!r.between_frames(), "within a payload");
        r.push(&f[100..], |_| seen += 1);
        assert!(r.between_frames());
        assert_eq!((seen, r.text.capacity()), (0, 0));
    }

    #[test]
    fn compressed_and_stray_frames_are_not_read() {
        let mut s = frame(true, 1 | 0x40, b"deflated", None);
        s.extend(frame(true, 0, b"stray", None));
        s.extend(frame(true, 1, DONE.as_bytes(), None));
        assert_eq!(read(&s, 2), ["<compressed>", DONE]);
    }
}
