//! The gateway's modules import one another one way only (docs/design.md §8): the graph of
//! `crate::` and `super::` paths between its source files is acyclic, file by file and top-level
//! module by top-level module, and `openai/` imports nothing of the crate.
//!
//! The graph is read from the source text: every path that starts with `crate::` or `super::`
//! (or names a child module declared with `mod`), outside comments and the `#[cfg(test)]`
//! module at a file's end, is an edge to the deepest module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file is: `src/http/mod.rs` and `src/http.rs` are `http`, `src/lib.rs` the root.
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The code of a file without its comments and its trailing test module.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    };
    let mut out = String::new();
    for line in text.lines() {
        // Comments only: a `//` inside a string literal would be rare in a `use` line.
        let code = match line.find("//") {
            Some(i) if !line[..i].contains('"') => &line[..i],
            _ => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The index of the `}` that closes the `{` at `open`.
fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0;
    for (i, b) in code.bytes().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// The paths of a `use` group's members (`a, b::{c, d}` gives `a`, `b::c`, `b::d`).
fn expand(group: &str) -> Vec<Vec<String>> {
    let mut members = Vec::new();
    let (mut depth, mut from) = (0, 0);
    for (i, b) in group.bytes().enumerate() {
        match b {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b',' if depth == 0 => {
                members.push(&group[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    members.push(&group[from..]);
    let mut out = Vec::new();
    for member in members {
        let member = member.trim();
        match member.find("::{") {
            Some(at) => {
                let head: Vec<String> = member[..at].split("::").map(str::to_owned).collect();
                let inner = &member[at + 3..member.len().saturating_sub(1)];
                for tail in expand(inner) {
                    let mut path = head.clone();
                    path.extend(tail);
                    out.push(path);
                }
            }
            None => out.push(
                member
                    .split("::")
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty() && s.bytes().all(is_ident))
                    .collect(),
            ),
        }
    }
    out
}

/// The paths written in `code` that start with one of `roots` (`crate`, `super`, or a child
/// module's name), each as its segments, a braced group expanded one level.
fn paths(code: &str, roots: &BTreeSet<String>) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident(bytes[i]) || (i > 0 && (is_ident(bytes[i - 1]) || bytes[i - 1] == b':')) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        let first = &code[start..i];
        if !roots.contains(first) || !code[i..].starts_with("::") {
            continue;
        }
        let mut segments = vec![first.to_owned()];
        loop {
            if !code[i..].starts_with("::") {
                break;
            }
            i += 2;
            if code[i..].starts_with('{') {
                let end = matching_brace(code, i);
                for member in expand(&code[i + 1..end]) {
                    let mut path = segments.clone();
                    path.extend(member);
                    found.push(path);
                }
                i = end;
                segments.clear();
                break;
            }
            let s = i;
            while i < bytes.len() && is_ident(bytes[i]) {
                i += 1;
            }
            if s == i {
                break;
            }
            segments.push(code[s..i].to_owned());
        }
        if !segments.is_empty() {
            found.push(segments);
        }
    }
    found
}

/// The modules `file` (module `me`) imports, among `modules`.
fn imports(me: &Module, text: &str, modules: &BTreeSet<Module>) -> BTreeSet<Module> {
    let code = code(text);
    let children: BTreeSet<String> = code
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l
                .strip_prefix("pub(crate) ")
                .or_else(|| l.strip_prefix("pub(super) "))
                .unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect();
    let mut roots = children.clone();
    roots.insert("crate".into());
    roots.insert("super".into());
    let mut out = BTreeSet::new();
    for path in paths(&code, &roots) {
        // Resolved against the crate root.
        let mut absolute: Module = match path[0].as_str() {
            "crate" => Vec::new(),
            "super" => me.clone(),
            _ => me.clone(),
        };
        let mut rest = &path[..];
        if rest[0] == "crate" {
            rest = &rest[1..];
        }
        while rest.first().is_some_and(|s| s == "super") {
            absolute.pop();
            rest = &rest[1..];
        }
        absolute.extend(rest.iter().cloned());
        // The deepest module the path names.
        while !absolute.is_empty() && !modules.contains(&absolute) {
            absolute.pop();
        }
        if !absolute.is_empty() && &absolute != me {
            out.insert(absolute);
        }
    }
    out
}

fn graph() -> BTreeMap<Module, BTreeSet<Module>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.retain(|f| f.file_name().is_some_and(|n| n != "main.rs"));
    let modules: BTreeSet<Module> = files.iter().map(|f| module_of(&src, f)).collect();
    files
        .iter()
        .map(|f| {
            let me = module_of(&src, f);
            let text = std::fs::read_to_string(f).unwrap();
            let edges = imports(&me, &text, &modules);
            (me, edges)
        })
        // The crate root re-exports; it is not a layer.
        .filter(|(me, _)| !me.is_empty())
        .collect()
}

/// A cycle in `graph`, if it has one, as the modules along it.
fn cycle(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Option<Vec<Module>> {
    fn visit(
        node: &Module,
        graph: &BTreeMap<Module, BTreeSet<Module>>,
        state: &mut BTreeMap<Module, u8>,
        stack: &mut Vec<Module>,
    ) -> Option<Vec<Module>> {
        match state.get(node) {
            Some(2) => return None,
            Some(1) => {
                let at = stack.iter().position(|n| n == node).unwrap_or(0);
                let mut found = stack[at..].to_vec();
                found.push(node.clone());
                return Some(found);
            }
            _ => {}
        }
        state.insert(node.clone(), 1);
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(node.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if let Some(c) = visit(node, graph, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

fn show(path: &[Module]) -> String {
    path.iter()
        .map(|m| m.join("::"))
        .collect::<Vec<_>>()
        .join(" -> ")
}

#[test]
fn the_files_import_one_another_one_way() {
    let g = graph();
    assert!(g.len() > 10, "the source files were found: {g:?}");
    if let Some(c) = cycle(&g) {
        panic!("an import cycle: {}", show(&c));
    }
}

#[test]
fn the_top_level_modules_import_one_another_one_way() {
    let mut top: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (from, to) in graph() {
        let from = vec![from[0].clone()];
        let entry = top.entry(from.clone()).or_default();
        for t in to {
            let t = vec![t[0].clone()];
            if t != from {
                entry.insert(t);
            }
        }
    }
    if let Some(c) = cycle(&top) {
        panic!("an import cycle: {}", show(&c));
    }
}

#[test]
fn the_protocol_is_a_leaf() {
    for (from, to) in graph() {
        if from[0] == "openai" {
            let outside: Vec<_> = to.iter().filter(|t| t[0] != "openai").collect();
            assert!(outside.is_empty(), "{from:?} imports {outside:?}");
        }
    }
}

/// The reader finds what a cycle looks like: the check is not vacuous.
#[test]
fn a_cycle_is_found() {
    let modules: BTreeSet<Module> = [vec!["a".to_owned()], vec!["b".to_owned()]].into();
    let a = imports(&vec!["a".into()], "use crate::b::Thing;\n", &modules);
    let b = imports(
        &vec!["b".into()],
        "fn f() { crate::a::g(); }\n// crate::c::ignored\n",
        &modules,
    );
    let g: BTreeMap<Module, BTreeSet<Module>> =
        [(vec!["a".to_owned()], a), (vec!["b".to_owned()], b)].into();
    assert_eq!(show(&cycle(&g).unwrap()), "a -> b -> a");
    let nested = paths(
        "use super::{frames::{self, X}, paths};",
        &["super".to_owned()].into(),
    );
    let want = |p: &[&str]| nested.contains(&p.iter().map(|s| s.to_string()).collect());
    assert!(want(&["super", "paths"]), "{nested:?}");
    assert!(want(&["super", "frames", "X"]), "{nested:?}");
}
