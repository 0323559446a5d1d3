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
    "rewrite",
];

/// The named seams between capabilities: (who, whom). The metric routes hand prepared writes to
/// the coalescer, node samples to deduplication and beats to run health; whoever acts for a
/// client asks MLflow through the authorizer; run health writes its tags through the coalescer.
pub(crate) const SEAMS: &[(&str, &str)] = &[
    ("rewrite", "coalesce"),
    ("rewrite", "dedup"),
    ("rewrite", "health"),
    ("rewrite", "authz"),
    ("artifacts", "authz"),
    // Run health's own tags (the GPU bill, idle GPUs) join their run's write queue.
    ("health", "coalesce"),
];

/// The shell: may import anything.
const SHELL: &[&str] = &[
    "admin", "app", "config", "fuzz", "floors", "main", "relocate", "serve", "state",
];

/// Every top-level module with the modules its code names as `crate::<name>`.
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
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or_default();
                let mut rest = code;
                while let Some(at) = rest.find("crate::") {
                    rest = &rest[at + "crate::".len()..];
                    let module: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !module.is_empty() && module != name {
                        named.insert(module);
                    }
                }
            }
        }
        modules.push((name, named));
    }
    modules
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
    assert!(forbidden("rewrite", "coalesce").is_none());
    assert!(forbidden("app", "rewrite").is_none());
    assert!(forbidden("newcomer", "proxy").is_some());
}
