"""Helpers shared by the end-to-end scripts that drive the MLflow Python client.

The scripts are run as `python <path>`, so this module, beside them, is importable as `e2e_common`.
"""

import hashlib
import sys


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_tree(root, files):
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def listed_files(client, run_id, path=None):
    """All file paths below `path`, walking directories the way the UI does."""
    found = {}
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            found.update(listed_files(client, run_id, info.path))
        else:
            found[info.path] = info.file_size
    return found


def run_checks(main):
    """Runs `main`; a failed check ends the script with its message on stderr and exit status 1."""
    try:
        main()
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        sys.exit(1)
