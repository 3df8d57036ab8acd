"""The optical fabric manager; its public face is :mod:`orchestr.fabric.optical`.

A system of its own beside the data plane (neither imports the other):

- the cabling plan: ``_topology`` (the model), ``_plancheck`` (its validation), ``_planfile``
  (TOML/YAML files), ``_fattree`` (generated plans);
- planning: ``_circuits`` (switch-to-switch circuits), ``_costmodel`` (collective and
  reconfiguration cost), ``_planner`` (the greedy planner and the commit policy);
- reconfiguration: ``_reconfig_model`` (the sans-IO transaction and its invariants),
  ``_reconfig`` (its async shell), ``_manager`` (hints in, plans applied);
- switches: ``_ocs`` (the driver seam), ``_ocs_sim``, ``_ocs_netns`` on the emulated fabric of
  ``_netns`` and ``_netns_kernel``; ``_conformance``: the checks every driver passes.
"""
