//! The floors of the crate and what each may import, enforced: a `crate::` path in a module's
//! code (comments aside) that its floor does not allow fails `every_module_imports_only_what_its_floor_allows`.

use std::collections::BTreeSet;
use std::path::Path;

/// Plumbing: imports only plumbing.
const PLUMBING: &[&str] = &[
    "aged",
    "client",
    "credential",
    "error",
    "identity",
    "layers",
    "listen",
    "mlflow",
    "proxy",
    "route",
    "settings",
    "store",
    "telemetry",
    "upstream",
    "workspace",
    "writes",
];

/// Capabilities: plumbing, and the seams below.
const CAPABILITIES: &[&str] = &[
    "artifacts",
    "authz",
    "coalesce",
    "dedup",
    "fairshare",
    "health",
    "metric_routes",
    "rewrite",
];

/// The named seams between capabilities: (who, whom). The metric routes have a body inspected by
/// the scope contract, hand the writes to the coalescer and a stored write's beat to run health;
/// the contract hands node samples to deduplication and builds the beat run health records;
/// whoever acts for a client asks MLflow through the authorizer; run health and the gateway write
/// their tags through the coalescer.
pub(crate) const SEAMS: &[(&str, &str)] = &[
    ("metric_routes", "rewrite"),
    ("metric_routes", "coalesce"),
    ("metric_routes", "health"),
    ("rewrite", "dedup"),
    ("rewrite", "health"),
    ("rewrite", "authz"),
    ("artifacts", "authz"),
    // The proxy's own run tags join their run's write queue: run health's (verdicts, the GPU
    // bill, idle GPUs) and the gateway's (upload failures).
    ("health", "coalesce"),
    ("artifacts", "coalesce"),
];

/// The shell: may import anything.
const SHELL: &[&str] = &[
    "admin", "app", "config", "fuzz", "floors", "main", "relocate", "serve", "state",
];

/// Every top-level module with the other top-level modules its code names: `crate::a`, each
/// name of a group (`crate::{a, b::c}`), and `super::` paths that climb out of the module
/// (`super::super::a` from `m/n/o.rs`), resolved from the file's place in the tree.
fn imports() -> Vec<(String, BTreeSet<String>)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" {
            continue;
        }
        let mut files = Vec::new();
        collect(&path, &mut files);
        let mut named = BTreeSet::new();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let place = module_path(file.strip_prefix(&src).unwrap());
            named.extend(
                named_modules(&place, &text)
                    .into_iter()
                    .filter(|m| *m != name),
            );
        }
        modules.push((name, named));
    }
    modules
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

/// The top-level modules `code` (a file of module `place`) names through `crate::` or through
/// `super::` climbing out of its top-level module; inline modules (`mod tests { … }`) count
/// as a level for `super::`.
fn named_modules(place: &[String], code: &str) -> BTreeSet<String> {
    let code = code_only(code);
    let ident = |text: &str| -> String {
        text.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
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
        let path: Option<(Vec<String>, &str)> = if boundary && rest.starts_with("crate::") {
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
        let Some((base, after)) = path else {
            at += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        at = code.len() - after.len();
        if let Some(top) = base.first() {
            // Still inside a top-level module: whatever it names there is its own.
            named.insert(top.clone());
            continue;
        }
        let after = after.trim_start();
        if let Some(group) = after.strip_prefix('{') {
            // `{a, b::c, d::{e}}`: the first name of each item at the group's own depth.
            let mut level = 0usize;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => level += 1,
                    '}' if level == 0 => break,
                    '}' => level -= 1,
                    ',' if level == 0 => item_start = true,
                    c if item_start && level == 0 && (c.is_ascii_alphabetic() || c == '_') => {
                        named.insert(ident(&group[i..]));
                        item_start = false;
                    }
                    c if c.is_whitespace() => {}
                    _ => item_start = false,
                }
            }
        } else {
            let module = ident(after);
            if !module.is_empty() {
                named.insert(module);
            }
        }
    }
    named.remove("self");
    named
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
fn forbidden(from: &str, to: &str) -> Option<&'static str> {
    let plumbing = |m: &str| PLUMBING.contains(&m);
    if SHELL.contains(&from) {
        None
    } else if plumbing(from) {
        (!plumbing(to)).then_some("plumbing imports only plumbing")
    } else if CAPABILITIES.contains(&from) {
        (!plumbing(to) && !SEAMS.contains(&(from, to)))
            .then_some("a capability imports plumbing, and other capabilities only through a seam in floors::SEAMS")
    } else {
        Some("a new top-level module must be given a floor in floors.rs")
    }
}

#[test]
fn every_module_imports_only_what_its_floor_allows() {
    let mut wrong = Vec::new();
    for (module, named) in imports() {
        if forbidden(&module, "error").is_some() {
            wrong.push(format!("{module}: has no floor"));
        }
        for to in named {
            if let Some(why) = forbidden(&module, &to) {
                wrong.push(format!("{module} -> {to}: {why}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_rule_refuses_what_it_should() {
    assert!(forbidden("proxy", "config").is_some());
    assert!(forbidden("telemetry", "health").is_some());
    assert!(forbidden("coalesce", "rewrite").is_some());
    assert!(forbidden("artifacts", "rewrite").is_some());
    assert!(forbidden("metric_routes", "coalesce").is_none());
    assert!(forbidden("rewrite", "coalesce").is_some());
    assert!(forbidden("app", "rewrite").is_none());
    assert!(forbidden("newcomer", "proxy").is_some());
}

#[test]
fn grouped_imports_and_super_paths_are_read_as_the_compiler_reads_them() {
    let at = |place: &[&str], code: &str| -> Vec<String> {
        let place: Vec<String> = place.iter().map(|p| p.to_string()).collect();
        named_modules(&place, code).into_iter().collect()
    };
    assert_eq!(
        at(
            &["telemetry"],
            "use crate::{error::Error, health::{Beat, Health}, self};"
        ),
        ["error", "health"]
    );
    assert_eq!(
        at(
            &["telemetry"],
            "use crate::{\n    proxy,\n    coalesce::Coalescer,\n};"
        ),
        ["coalesce", "proxy"]
    );
    // `super::` climbs from the file's module: out of `health` only from its root's children.
    assert_eq!(
        at(
            &["health", "bill"],
            "use super::judge; use super::super::rewrite::X;"
        ),
        ["health", "rewrite"]
    );
    assert_eq!(
        at(&["proxy"], "let x = super::relocate::run();"),
        ["relocate"]
    );
    // A comment, and a path that merely ends in `crate::`, name nothing.
    assert!(at(
        &["proxy"],
        "// use crate::health;\nlet s = mlscope_crate::health;"
    )
    .is_empty());
    // Inside an inline module, `super::super` climbs one level less far; strings are not code.
    let tests = "let f = format!(\"{x}}}\"); mod tests { use super::super::S3; fn f() { let c = '}'; } }\nuse super::super::health::X;";
    assert_eq!(at(&["artifacts", "routes"], tests), ["artifacts", "health"]);
    assert_eq!(
        at(
            &["a"],
            "let r = r#\"crate::health\"#; let s = \"crate::x\";"
        ),
        Vec::<String>::new()
    );
    assert_eq!(module_path(Path::new("health/mod.rs")), ["health"]);
    assert_eq!(module_path(Path::new("health/bill.rs")), ["health", "bill"]);
    // The probe: plumbing naming a capability inside a group is refused.
    let named = at(&["telemetry"], "use crate::{error, health::Beat};");
    assert!(named.iter().any(|to| forbidden("telemetry", to).is_some()));
}
