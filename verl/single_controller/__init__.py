"""The single controller: one driver process drives groups of worker processes.

`base/` is backend-neutral (the `Worker` base class, `@register` with its dispatch modes, errors);
`ray/` runs worker groups on Ray. Importing this package imports neither
ray nor torch; `verl.single_controller.ray` imports ray.
"""
