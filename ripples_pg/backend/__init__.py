"""The ``ripples`` c10d backend, the package's lowest layer: the group's options
(``options``), loading the C extension (``_extension``), registration and the creator torch calls
(``_register``), the records sealed in the c10d store (``_records``), incarnations of a
restarted job (``_incarnation``), the coordinators a group runs for itself
(``_group_coordinators``) and the Group Generator's binding and command line (``_gg``,
``coordinator``), and the Python face of a group: ``partial()``, ``stats()`` (``_api``,
``attribution``).

Imports nothing of the layers above (``training``, ``integrations``, ``tools``); nothing is
imported here, so ``import ripples_pg`` (inside ``import torch``, see ripples_pg/__init__.py)
loads only what registration needs.
"""
