"""End-to-end check with the real MLflow Python client against MLFLOW_TRACKING_URI (the proxy).

Everything written is read back through the same URI and compared: metrics, params, tags,
artifacts (files, nested directories, and a 50 MiB random file checked by SHA-256). Exits non-zero
with a message on the first difference.
"""

import os
import tempfile
import uuid
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from e2e_common import check, listed_files, run_checks, sha256_of, write_tree

BIG_ARTIFACT_BYTES = 50 * 1024 * 1024


def check_equal(actual, expected, what):
    check(actual == expected, f"{what}: read back {actual!r}, wrote {expected!r}")


def main():
    tracking_uri = os.environ["MLFLOW_TRACKING_URI"]
    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient()
    suffix = uuid.uuid4().hex[:12]

    experiment_id = mlflow.create_experiment(f"python-e2e-{suffix}")
    check_equal(client.get_experiment(experiment_id).name, f"python-e2e-{suffix}", "experiment name")
    mlflow.set_experiment(experiment_id=experiment_id)

    metrics = {"accuracy": 0.875, "loss": 0.3125}
    params = {"learning_rate": "0.001", "optimizer": "adamw", "layers": "12"}

    with tempfile.TemporaryDirectory() as scratch, mlflow.start_run(run_name=f"e2e-{suffix}") as run:
        scratch = Path(scratch)
        run_id = run.info.run_id

        for step in range(5):
            mlflow.log_metric("epoch_loss", 1.0 / (step + 1), step=step)
        mlflow.log_metrics(metrics, step=7)
        mlflow.log_params(params)
        mlflow.set_tag("purpose", "mlscope end-to-end")

        single = scratch / "single.txt"
        single.write_text("one artifact\n")
        mlflow.log_artifact(str(single))

        tree = {
            "config.yaml": b"epochs: 5\n",
            "nested/weights.bin": os.urandom(4096),
            "nested/deeper/notes.md": "# deep\n\u00fcnicode content\n".encode(),
        }
        write_tree(scratch / "tree", tree)
        mlflow.log_artifacts(str(scratch / "tree"), artifact_path="bundle")

        big = scratch / "big.bin"
        with open(big, "wb") as file:
            for _ in range(BIG_ARTIFACT_BYTES // (1 << 20)):
                file.write(os.urandom(1 << 20))
        big_sha = sha256_of(big)
        mlflow.log_artifact(str(big), artifact_path="large")

        # --- read everything back through the proxy ---
        data = client.get_run(run_id).data
        check_equal(data.params, params, "params")
        check_equal({k: data.metrics[k] for k in metrics}, metrics, "latest metrics")
        check_equal(data.metrics["epoch_loss"], 1.0 / 5, "latest epoch_loss")
        check_equal(data.tags.get("purpose"), "mlscope end-to-end", "tag purpose")

        history = client.get_metric_history(run_id, "epoch_loss")
        check_equal(
            sorted((m.step, m.value) for m in history),
            [(step, 1.0 / (step + 1)) for step in range(5)],
            "epoch_loss history",
        )

        expected_listing = {"single.txt": single.stat().st_size, "large/big.bin": BIG_ARTIFACT_BYTES}
        expected_listing.update({f"bundle/{name}": len(content) for name, content in tree.items()})
        check_equal(listed_files(client, run_id), expected_listing, "artifact listing")

        downloaded = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="bundle", dst_path=str(scratch / "dl")))
        for name, content in tree.items():
            check_equal((downloaded / name).read_bytes(), content, f"downloaded bundle/{name}")
        single_back = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="single.txt", dst_path=str(scratch / "dl1"))
        check_equal(Path(single_back).read_text(), "one artifact\n", "downloaded single.txt")
        big_back = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="large/big.bin", dst_path=str(scratch / "dl2"))
        check_equal(os.path.getsize(big_back), BIG_ARTIFACT_BYTES, "size of large/big.bin")
        check_equal(sha256_of(big_back), big_sha, "sha256 of large/big.bin")

    found = mlflow.search_runs(experiment_ids=[experiment_id], filter_string="params.optimizer = 'adamw'", output_format="list")
    check_equal([r.info.run_id for r in found], [run_id], "search_runs by param")
    check_equal(found[0].info.status, "FINISHED", "status after the run ended")
    check_equal(client.get_run(run_id).info.status, "FINISHED", "status read back")
    print(f"ok: run {run_id} in experiment {experiment_id} round-tripped through {tracking_uri}")


if __name__ == "__main__":
    run_checks(main)
