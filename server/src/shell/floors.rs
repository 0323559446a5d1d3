//! The floors of the crate and what each may import, enforced. A module's floor is the folder it
//! lives in (`src/plumbing/`, `src/capabilities/`, `src/shell/`); a path in its code (comments
//! and string literals aside) to a module its floor does not allow fails
//! `every_module_imports_only_what_its_floor_allows`: `crate::` paths, each name of a grouped
//! import (`crate::{plumbing::a, capabilities::{b, c}}`), and `super::` paths that climb out of
//! the module.

use std::collections::BTreeSet;
use std::path::Path;

/// The floors, from the bottom.
const FLOORS: [&str; 3] = ["plumbing", "capabilities", "shell"];

/// The named seams between capabilities: (who, whom). The metric routes have a body inspected by
/// the scope contract, hand the writes to the coalescer and a stored write's beat to run health;
/// the contract hands node samples to deduplication and builds the beat run health records;
/// whoever acts for a client asks MLflow through the authorizer; run health writes its tags
/// through the coalescer.
pub(crate) const SEAMS: &[(&str, &str)] = &[
    ("metric_routes", "rewrite"),
    ("metric_routes", "coalesce"),
    ("metric_routes", "health"),
    ("rewrite", "dedup"),
    ("rewrite", "health"),
    ("rewrite", "authz"),
    ("artifacts", "authz"),
    // The gateway's upload-failure tags join their run's write queue.
    ("artifacts", "coalesce"),
    // Run health's own tags (the GPU bill, idle GPUs) join their run's write queue.
    ("health", "coalesce"),
];

/// A module of a floor: `(floor, name)`.
type Module = (String, String);

/// Every module of every floor with the other modules its code names, and whatever sits in
/// `src/` outside the floors.
fn imports() -> (Vec<(Module, BTreeSet<Module>)>, Vec<String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut outside = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if !FLOORS.contains(&name.as_str()) && name != "lib.rs" && name != "main.rs" {
            outside.push(name);
        }
    }
    let mut modules = Vec::new();
    for floor in FLOORS {
        for entry in std::fs::read_dir(src.join(floor)).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if name == "mod" {
                continue;
            }
            let own = (floor.to_owned(), name);
            let mut files = Vec::new();
            collect(&path, &mut files);
            let mut named = BTreeSet::new();
            for file in files {
                let text = std::fs::read_to_string(&file).unwrap();
                let place = module_path(file.strip_prefix(&src).unwrap());
                named.extend(
                    named_modules(&place, &text)
                        .into_iter()
                        .filter(|m| *m != own),
                );
            }
            modules.push((own, named));
        }
    }
    (modules, outside)
}

/// The module a file under `src/` is: `health/bill.rs` is `[health, bill]`, `health/mod.rs`
/// and `health.rs` are `[health]`.
fn module_path(relative: &Path) -> Vec<String> {
    let mut path: Vec<String> = relative
        .with_extension("")
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    if path.last().is_some_and(|last| last == "mod") {
        path.pop();
    }
    path
}

/// `code` without comments and without the text of string and character literals (`"…"` becomes
/// `""`), so neither a path in a comment nor a brace in a format string is read as code.
fn code_only(code: &str) -> String {
    let chars: Vec<char> = code.chars().collect();
    let mut out = String::with_capacity(code.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                i += 1;
            }
            i += 2;
        } else if c == 'r'
            && matches!(next, Some('"') | Some('#'))
            && !chars[..i]
                .last()
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            while j < chars.len()
                && !(chars[j] == '"' && (0..hashes).all(|h| chars.get(j + 1 + h) == Some(&'#')))
            {
                j += 1;
            }
            out.push_str("\"\"");
            i = j + 1 + hashes;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i += 1;
        } else if c == '\'' && (chars.get(i + 2) == Some(&'\'') || next == Some('\\')) {
            // A character literal ('{', '\n', '\u{7f}'); a lifetime ('a) is code.
            let mut j = i + 1;
            if chars.get(j) == Some(&'\\') {
                j += 1;
            }
            j += 1;
            while j < chars.len() && chars[j] != '\'' {
                j += 1;
            }
            out.push_str("' '");
            i = j + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The modules of a floor that `code` (a file of module `place`) names through `crate::` or
/// through `super::` climbing out of its module; inline modules (`mod tests { … }`) count as a
/// level for `super::`.
fn named_modules(place: &[String], code: &str) -> BTreeSet<Module> {
    let code = code_only(code);
    let mut named = BTreeSet::new();
    // Inline modules open at this point: (name, the brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let bytes = code.as_bytes();
    let mut at = 0;
    while at < code.len() {
        let rest = &code[at..];
        let boundary = at == 0
            || !(bytes[at - 1].is_ascii_alphanumeric()
                || matches!(bytes[at - 1], b'_' | b':' | b'$'));
        if rest.starts_with('{') {
            depth += 1;
        } else if rest.starts_with('}') {
            if inline.last().is_some_and(|(_, d)| *d == depth) {
                inline.pop();
            }
            depth = depth.saturating_sub(1);
        } else if boundary && rest.starts_with("mod ") {
            let name = ident(rest["mod ".len()..].trim_start());
            let after = rest["mod ".len()..].trim_start()[name.len()..].trim_start();
            if !name.is_empty() && after.starts_with('{') {
                inline.push((name, depth + 1));
            }
        }
        let start: Option<(Vec<String>, &str)> = if boundary && rest.starts_with("crate::") {
            Some((Vec::new(), &rest["crate::".len()..]))
        } else if boundary && rest.starts_with("super::") {
            let mut base: Vec<String> = place.to_vec();
            base.extend(inline.iter().map(|(name, _)| name.clone()));
            let mut after = rest;
            while let Some(next) = after.strip_prefix("super::") {
                base.pop();
                after = next;
            }
            Some((base, after))
        } else {
            None
        };
        let Some((base, after)) = start else {
            at += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        let mut paths = Vec::new();
        let end = use_tree(after, base, &mut paths);
        at = code.len() - after.len() + end;
        for path in paths {
            if let [floor, module, ..] = path.as_slice() {
                if FLOORS.contains(&floor.as_str()) {
                    named.insert((floor.clone(), module.clone()));
                }
            }
        }
    }
    named
}

fn ident(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Reads a path or use tree at the start of `text` (`a::b`, `a::{b, c::{d}}`, `*`) below
/// `prefix`, adding each path it names (its first segments are enough) to `out`; returns how
/// many bytes it read.
fn use_tree(text: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    let mut at = 0;
    loop {
        let rest = &text[at..];
        let trimmed = rest.trim_start();
        at += rest.len() - trimmed.len();
        if let Some(group) = trimmed.strip_prefix('{') {
            at += 1;
            let mut inner = group;
            loop {
                let skipped = inner.len()
                    - inner
                        .trim_start_matches(|c: char| c.is_whitespace() || c == ',')
                        .len();
                at += skipped;
                inner = &inner[skipped..];
                if inner.is_empty() {
                    return at;
                }
                if let Some(after) = inner.strip_prefix('}') {
                    let _ = after;
                    return at + 1;
                }
                let read = use_tree(inner, path.clone(), out);
                if read == 0 {
                    // Not a path (e.g. `self`, `*`): skip one character.
                    at += inner.chars().next().map_or(1, char::len_utf8);
                    inner = &inner[inner.chars().next().map_or(1, char::len_utf8)..];
                } else {
                    at += read;
                    inner = &inner[read..];
                }
            }
        }
        let segment = ident(trimmed);
        if segment.is_empty() || segment == "self" {
            if !path.is_empty() {
                out.push(path);
            }
            return if segment == "self" { at + 4 } else { at };
        }
        at += segment.len();
        path.push(segment);
        match text[at..].strip_prefix("::") {
            Some(_) => at += 2,
            None => {
                out.push(path);
                return at;
            }
        }
    }
}

fn collect(path: &Path, files: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            collect(&entry.unwrap().path(), files);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        files.push(path.to_owned());
    }
}

/// Why `from` may not name `to`; `None` when its floor allows it.
fn forbidden(from: &Module, to: &Module) -> Option<&'static str> {
    match (from.0.as_str(), to.0.as_str()) {
        ("shell", _) | ("plumbing", "plumbing") | ("capabilities", "plumbing") => None,
        ("plumbing", _) => Some("plumbing imports only plumbing"),
        ("capabilities", "capabilities") if SEAMS.contains(&(from.1.as_str(), to.1.as_str())) => {
            None
        }
        ("capabilities", "capabilities") => {
            Some("a capability imports another capability only through a seam in floors::SEAMS")
        }
        _ => Some("a capability imports plumbing, and other capabilities through a seam"),
    }
}

#[test]
fn every_module_imports_only_what_its_floor_allows() {
    let (modules, outside) = imports();
    let mut wrong: Vec<String> = outside
        .iter()
        .map(|name| format!("src/{name}: every module lives in a floor's folder"))
        .collect();
    for (module, named) in &modules {
        for to in named {
            if let Some(why) = forbidden(module, to) {
                wrong.push(format!(
                    "{}::{} -> {}::{}: {why}",
                    module.0, module.1, to.0, to.1
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Every seam joins two capabilities that exist.
    for (from, to) in SEAMS {
        for name in [from, to] {
            assert!(
                modules
                    .iter()
                    .any(|(m, _)| m.0 == "capabilities" && m.1 == *name),
                "floors::SEAMS names {name}, which is no capability"
            );
        }
    }
}

#[cfg(test)]
fn module(floor: &str, name: &str) -> Module {
    (floor.to_owned(), name.to_owned())
}

#[test]
fn the_rule_refuses_what_it_should() {
    let (plumbing, capability, shell) = (
        module("plumbing", "proxy"),
        module("capabilities", "coalesce"),
        module("shell", "config"),
    );
    assert!(forbidden(&plumbing, &shell).is_some());
    assert!(forbidden(&plumbing, &capability).is_some());
    assert!(forbidden(&capability, &shell).is_some());
    assert!(forbidden(&capability, &module("capabilities", "rewrite")).is_some());
    assert!(forbidden(&module("capabilities", "metric_routes"), &capability).is_none());
    assert!(forbidden(&capability, &plumbing).is_none());
    assert!(forbidden(&shell, &capability).is_none());
}

#[test]
fn grouped_imports_and_super_paths_are_read_as_the_compiler_reads_them() {
    let at = |place: &[&str], code: &str| -> Vec<String> {
        let place: Vec<String> = place.iter().map(|p| p.to_string()).collect();
        named_modules(&place, code)
            .into_iter()
            .map(|(floor, name)| format!("{floor}::{name}"))
            .collect()
    };
    let telemetry = ["plumbing", "telemetry"];
    assert_eq!(
        at(
            &telemetry,
            "use crate::{plumbing::error::Error, capabilities::{health::{Beat, Health}, self}};"
        ),
        ["capabilities::health", "plumbing::error"]
    );
    assert_eq!(
        at(
            &telemetry,
            "use crate::plumbing::{\n    proxy,\n    store::Store,\n};"
        ),
        ["plumbing::proxy", "plumbing::store"]
    );
    // `super::` climbs from the file's module.
    let bill = ["capabilities", "health", "bill"];
    assert_eq!(
        at(
            &bill,
            "use super::judge; use super::super::rewrite::X; use super::super::super::shell::app;"
        ),
        [
            "capabilities::health",
            "capabilities::rewrite",
            "shell::app"
        ]
    );
    // Inside an inline module, `super::super` climbs one level less far; strings are not code.
    let routes = ["capabilities", "artifacts", "routes"];
    let tests = "let f = format!(\"{x}}}\"); mod tests { use super::super::S3; fn f() { let c = '}'; } }\nuse super::super::health::X;";
    assert_eq!(
        at(&routes, tests),
        ["capabilities::artifacts", "capabilities::health"]
    );
    assert!(at(&["plumbing", "proxy"], "// use crate::capabilities::health;\nlet s = mlscope_crate::capabilities::health; let r = r#\"crate::shell::app\"#;").is_empty());
    assert_eq!(
        module_path(Path::new("capabilities/health/mod.rs")),
        ["capabilities", "health"]
    );
    // The probe: plumbing naming a capability inside a group is refused.
    let named = named_modules(
        &["plumbing".to_owned(), "telemetry".to_owned()],
        "use crate::{plumbing::error, capabilities::health::Beat};",
    );
    let telemetry = module("plumbing", "telemetry");
    assert!(named.iter().any(|to| forbidden(&telemetry, to).is_some()));
}
