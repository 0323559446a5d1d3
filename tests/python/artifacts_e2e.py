"""The MLflow Python client's artifact calls against MLFLOW_TRACKING_URI (the artifact gateway).

log_artifact, log_artifacts, list_artifacts and download_artifacts on a small tree, then a file of
MLSCOPE_MULTIPART_BYTES (default 600 MiB) that the client uploads with MLflow's multipart protocol
(presigned part URLs); everything is read back and compared by SHA-256. Prints the run's ids as
`run <experiment_id> <run_id>` for the caller's own checks. Exits non-zero on the first difference.
"""

import os
import tempfile
import uuid
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from e2e_common import check, listed_files, run_checks, sha256_of, write_tree


def main():
    big_bytes = int(os.environ.get("MLSCOPE_MULTIPART_BYTES", str(600 << 20)))
    client = MlflowClient()
    experiment_id = mlflow.create_experiment(f"artifacts-e2e-{uuid.uuid4().hex[:12]}")
    with tempfile.TemporaryDirectory() as scratch, mlflow.start_run(experiment_id=experiment_id) as run:
        scratch = Path(scratch)
        run_id = run.info.run_id
        print(f"run {experiment_id} {run_id}", flush=True)

        single = scratch / "metrics summary.json"
        single.write_text('{"accuracy": 0.9}\n')
        mlflow.log_artifact(str(single))

        tree = {
            "config.yaml": b"epochs: 5\n",
            "empty.txt": b"",
            "weights/layer_0.bin": os.urandom(3 << 20),
            "weights/deeper/\u00fcnicode notes.md": "# \u00fc\n".encode(),
        }
        write_tree(scratch / "tree", tree)
        mlflow.log_artifacts(str(scratch / "tree"), artifact_path="bundle")

        big = scratch / "checkpoint.pt"
        with open(big, "wb") as file:
            block = os.urandom(1 << 20)
            for i in range(big_bytes >> 20):
                # Every MiB differs, so a part written at the wrong offset changes the hash.
                file.write(i.to_bytes(8, "little") + block[8:])
        big_sha = sha256_of(big)
        mlflow.log_artifact(str(big), artifact_path="checkpoints")
        print(f"uploaded {big_bytes} bytes", flush=True)

        expected = {"metrics summary.json": single.stat().st_size, "checkpoints/checkpoint.pt": big_bytes}
        expected.update({f"bundle/{name}": (len(content) or None) for name, content in tree.items()})
        listing = listed_files(client, run_id)
        check(listing == expected, f"listing: got {listing!r}, expected {expected!r}")

        back = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="bundle", dst_path=str(scratch / "dl")))
        for name, content in tree.items():
            check((back / name).read_bytes() == content, f"downloaded bundle/{name} differs")
        one = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="metrics summary.json", dst_path=str(scratch / "dl1"))
        check(Path(one).read_text() == '{"accuracy": 0.9}\n', "downloaded metrics summary.json differs")
        big.unlink()
        big_back = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="checkpoints/checkpoint.pt", dst_path=str(scratch / "dl2"))
        check(os.path.getsize(big_back) == big_bytes, "size of checkpoints/checkpoint.pt")
        check(sha256_of(big_back) == big_sha, "sha256 of checkpoints/checkpoint.pt")
    print(f"ok: artifacts of run {run_id} round-tripped, {big_bytes} byte multipart file included")


if __name__ == "__main__":
    run_checks(main)
