"""Upstream scripts build their own driver from `verl.trainer.ppo.ray_trainer`; those imports work,
and importing the module alone does not start importing ray."""

from __future__ import annotations

import subprocess
import sys


def test_upstream_driver_imports_resolve_to_the_single_controller_classes():
    from verl.single_controller.ray import ResourcePoolManager as manager_cls
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager, Role

    assert ResourcePoolManager is manager_cls
    assert Role.ActorRollout and callable(RayPPOTrainer)


def test_importing_the_trainer_module_does_not_import_ray():
    code = "import sys, verl.trainer.ppo.ray_trainer; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
