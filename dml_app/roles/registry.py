"""The roles a structure conf may name (``ROLES``, by the name of each built-in), and the user's
classes that replace them (an ``algorithm`` of the structure conf: a file of classes, each a
subclass of one built-in role, keeping its name).
"""
from __future__ import annotations

from typing import Any

from dml_app.roles.base import Role
from dml_app.roles.etree import ETreeRole
from dml_app.roles.fl import AggregatorRole, TrainerRole
from dml_app.roles.gossip import GossipRole
from dml_app.roles.ring import RingRole
from dml_app.runtime.usercode import UserCodeError, attribute, load_file, shown

ROLES: dict[str, type[Role]] = {r.name: r for r in (GossipRole, AggregatorRole, TrainerRole, ETreeRole, RingRole)}


def role_class(conf: dict[str, Any], workdir: str) -> type[Role]:
    """The class of the conf's role: the built-in one, or the user's ``algorithm`` class that
    subclasses it (``{"module": "dml_user/algos/x.py", "classes": ["FedProxTrainer"], ...}``)."""
    builtin = ROLES[conf["role"]]
    algorithm = conf.get("algorithm")
    if not algorithm:
        return builtin
    if not isinstance(algorithm, dict):
        raise UserCodeError("algorithm must be an object naming a module and its classes")
    return user_roles(workdir, str(algorithm.get("module")), algorithm.get("classes") or []).get(conf["role"], builtin)


def user_roles(workdir: str, relative: str, classes: list[str]) -> dict[str, type[Role]]:
    """The user's classes of file ``relative`` by the built-in role each replaces: the built-in
    role it subclasses (its ``name`` must stay that role's); two for one role are refused."""
    module = load_file(workdir, relative)
    found: dict[str, type[Role]] = {}
    for name in classes:
        cls = attribute(module, relative, name, "class")
        builtin = next((b for b in cls.__mro__ if b in ROLES.values()), None) if isinstance(cls, type) else None
        if builtin is None:
            raise UserCodeError(f"{shown(relative)}: {name} must subclass one of the built-in roles "
                                f"({', '.join(r.__name__ for r in ROLES.values())})")
        if cls.name != builtin.name:
            raise UserCodeError(f"{shown(relative)}: {name} subclasses {builtin.__name__} but names itself {cls.name!r}: "
                                f"a role's name stays its built-in's ({builtin.name!r})")
        _no_shadowed_hooks(cls, builtin, relative)
        if builtin.name in found:
            raise UserCodeError(f"{shown(relative)}: {found[builtin.name].__name__} and {name} both replace "
                                f"{builtin.__name__}: name one class per role")
        found[builtin.name] = cls
    return found


SHADOWED = ("aggregation", "aggregations")  # the roles' rule objects, which a method would not replace


def _no_shadowed_hooks(cls: type, builtin: type, relative: str) -> None:
    """Refuse a method named like the rule objects the roles hold: the role never calls it."""
    for klass in cls.__mro__:
        if klass in builtin.__mro__:
            break
        for attr in SHADOWED:
            method = vars(klass).get(attr)
            if callable(method):
                line = getattr(getattr(method, "__code__", None), "co_firstlineno", None)
                at = f" (line {line})" if line else ""
                raise UserCodeError(f"{shown(relative)}: {klass.__name__}.{attr}{at} is a method, which the role "
                                    f"never calls ({attr} holds the structure's rule); define "
                                    f"aggregate(self, current, updates, counts) -> weights instead")
