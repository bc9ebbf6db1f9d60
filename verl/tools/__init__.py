"""Tools a model can call in multi-turn rollouts (see docs/multi_turn.md).

- `base_tool.BaseTool`: upstream verl's tool interface (create / execute / release, a timeout).
- `function_tool.FunctionTool`: a Python function or async callable as a tool.
- `calculator_tool.CalculatorTool`: exact arithmetic on an expression (no code execution).
- `sandbox_python_tool.PythonSandboxTool`: Python in a confined subprocess.
- `sandbox_fusion_tools.SandboxFusionTool`: code run on a SandboxFusion service (upstream's tool and
  execution-pool names); `sandbox_fusion_service`: a local, Python-only stand-in for that service.
- `utils.tool_registry.initialize_tools_from_config`: tools from upstream's tool-config YAML.
"""
