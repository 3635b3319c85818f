"""Model-family plug-ins: one package per family (`families/<name>/`), registered by name in
`common/families.py` (`REGISTERED`).

A family package sits above the services it plugs into: its `__init__.py` holds only the `FAMILY` descriptor (plain
data from `common.families`), and each part module extends one service through the part type that service
declares. The services never import this package; they load a family's parts by name through the registry
(`common.families.Family.part`), so the import graph between packages points one way: launcher -> families ->
services -> common -> protos.
"""
