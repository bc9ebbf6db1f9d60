import subprocess
import sys


def test_import_verl_is_light():
    """`import verl` must not pull in ray, transformers, mlflow (or torch)."""
    code = (
        "import sys, verl; heavy = [m for m in ('ray', 'transformers', 'mlflow', 'torch', 'wandb') if m in sys.modules];"
        "print(','.join(heavy)); print(verl.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "", f"import verl pulled in: {out[0]}"
    assert out[1].count(".") == 2
