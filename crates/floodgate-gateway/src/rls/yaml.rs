//! A YAML document as a tree whose every node knows its line, for errors that name file, line
//! and field. Built from `saphyr-parser`'s events: the rate limit config needs mappings,
//! sequences and scalars, nothing more (anchors, aliases and tags are refused).

use saphyr_parser::{Event, Parser, ScalarStyle, Span};

/// A node and the line (1-based) it starts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The line the node starts on.
    pub line: usize,
    /// What it is.
    pub value: Value,
}

/// A node's content.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar's text; `plain` when written unquoted (`~`, `null` or nothing then mean null).
    Scalar {
        /// The text.
        text: String,
        /// Unquoted.
        plain: bool,
    },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in document order: each key's text and line, and its value.
    Map(Vec<(String, usize, Node)>),
}

impl Node {
    /// Whether this is a null (an empty document, `key:` with nothing, `~`, `null`).
    pub fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar { text, plain: true }
            if text.is_empty() || text == "~" || text.eq_ignore_ascii_case("null"))
    }
}

/// How deep sequences and mappings may nest: far past any config (a descriptor level takes
/// two), and shallow enough that a tree is built and dropped without a deep recursion.
const MAX_DEPTH: usize = 128;

/// Parses `text` (one document) into its tree; an empty document is a null scalar. An error is
/// the line and what is wrong.
pub fn parse(text: &str) -> Result<Node, (usize, String)> {
    let mut stack: Vec<(usize, Building)> = Vec::new();
    let mut root = None;
    let mut documents = 0;
    for event in Parser::new_from_str(text) {
        let (event, span): (Event<'_>, Span) =
            event.map_err(|e| (e.marker().line(), e.info().to_owned()))?;
        let line = span.start.line();
        let node = match event {
            Event::DocumentStart(_) => {
                documents += 1;
                if documents > 1 {
                    return Err((line, "one YAML document per file".to_owned()));
                }
                continue;
            }
            Event::Alias(_) => {
                return Err((line, "YAML aliases are not supported".to_owned()));
            }
            Event::Scalar(text, style, anchor, tag) => {
                if anchor != 0 || tag.is_some() {
                    return Err((line, "YAML anchors and tags are not supported".to_owned()));
                }
                Node {
                    line,
                    value: Value::Scalar {
                        text: text.into_owned(),
                        plain: style == ScalarStyle::Plain,
                    },
                }
            }
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) if anchor != 0 => {
                return Err((line, "YAML anchors are not supported".to_owned()));
            }
            Event::SequenceStart(_, Some(_)) | Event::MappingStart(_, Some(_)) => {
                return Err((line, "YAML tags are not supported".to_owned()));
            }
            Event::SequenceStart(..) | Event::MappingStart(..) if stack.len() >= MAX_DEPTH => {
                // A tree this deep is no rate limit config, and dropping one nested a million
                // deep would recurse past the stack.
                return Err((line, format!("nested more than {MAX_DEPTH} deep")));
            }
            Event::SequenceStart(..) => {
                stack.push((line, Building::Seq(Vec::new())));
                continue;
            }
            Event::MappingStart(..) => {
                stack.push((line, Building::Map(Vec::new(), None)));
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => match stack.pop() {
                Some((start, Building::Seq(items))) => Node {
                    line: start,
                    value: Value::Seq(items),
                },
                Some((start, Building::Map(entries, _))) => Node {
                    line: start,
                    value: Value::Map(entries),
                },
                None => continue,
            },
            _ => continue,
        };
        match stack.last_mut() {
            None => root = Some(node),
            Some((_, Building::Seq(items))) => items.push(node),
            Some((_, Building::Map(entries, key))) => match key.take() {
                None => match node.value {
                    Value::Scalar { text, .. } => *key = Some((text, node.line)),
                    _ => return Err((node.line, "a mapping key must be a string".to_owned())),
                },
                Some((k, at)) => {
                    if entries.iter().any(|(e, _, _)| *e == k) {
                        return Err((at, format!("duplicate key `{k}`")));
                    }
                    entries.push((k, at, node));
                }
            },
        }
    }
    Ok(root.unwrap_or(Node {
        line: 1,
        value: Value::Scalar {
            text: String::new(),
            plain: true,
        },
    }))
}

enum Building {
    Seq(Vec<Node>),
    /// The entries so far and a key waiting for its value.
    Map(Vec<(String, usize, Node)>, Option<(String, usize)>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_carry_their_lines() {
        let n = parse("domain: d\ndescriptors:\n  - key: a\n    value: '1'\n").unwrap();
        let Value::Map(entries) = &n.value else {
            panic!("{n:?}")
        };
        assert_eq!(entries[0].0, "domain");
        assert_eq!(entries[1].1, 2);
        let Value::Seq(items) = &entries[1].2.value else {
            panic!()
        };
        assert_eq!(items[0].line, 3);
        let Value::Map(d) = &items[0].value else {
            panic!()
        };
        assert_eq!(d[1].1, 4);
        assert_eq!(
            d[1].2.value,
            Value::Scalar {
                text: "1".into(),
                plain: false
            }
        );
    }

    #[test]
    fn errors_name_their_line() {
        assert_eq!(parse("a: 1\na: 2\n").unwrap_err().0, 2);
        assert_eq!(parse("a: &x 1\nb: *x\n").unwrap_err().0, 1);
        assert!(parse("a: [1\n").is_err());
        assert!(parse("").unwrap().is_null());
    }

    #[test]
    fn tags_on_collections_and_deep_nesting_are_refused() {
        assert!(parse("a: !foo {b: 1}\n").unwrap_err().1.contains("tags"));
        assert!(parse("a: !foo [1]\n").unwrap_err().1.contains("tags"));
        // A million levels: refused at the cap, never built (nor dropped, which would recurse
        // once a level).
        let deep = "- ".repeat(1_000_000) + "x\n";
        assert!(parse(&deep).unwrap_err().1.contains("nested"));
        let ok = "- ".repeat(MAX_DEPTH) + "x\n";
        assert!(parse(&ok).is_ok());
    }
}
