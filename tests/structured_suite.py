"""A suite of JSON-schema requests for structured-output runs on real weights
(``tests/test_grammar_integration.py`` and ``scripts/bench/structured_output_bench.py``): 50 schemas from 5
templates (a flat record, a product with a pattern, numbers and an array, nested objects, enums, an array of
objects), each varied in its sizes, enum values and optional parts, with a chat prompt that asks for it. Every
object has ``additionalProperties: false`` and every string and array a bound, so every output is finite.
"""

from __future__ import annotations

SUBJECTS = ["a library member", "a hiking club volunteer", "a chess player", "a nurse", "a bakery customer",
            "a software engineer", "a student", "a retired teacher", "a taxi driver", "a gardener"]
PRODUCTS = ["a desk lamp", "running shoes", "a coffee grinder", "a backpack", "a phone case", "a kettle",
            "a yoga mat", "headphones", "a bicycle helmet", "a water bottle"]
PLACES = ["a bookshop in Lyon", "a dental clinic in Austin", "a bakery in Kyoto", "a gym in Oslo",
          "a school in Nairobi", "a cafe in Lisbon", "a museum in Boston", "a hotel in Prague", "a pharmacy in Lima",
          "a garage in Leeds"]
TICKETS = ["a login bug", "a slow search page", "a broken invoice export", "a typo on the home page",
           "a failed payment", "a crash on startup", "a missing translation", "an expired certificate",
           "a duplicated email", "a dark-mode glitch"]
ORDERS = ["a grocery order", "a stationery order", "a hardware store order", "a pet shop order", "a florist order",
          "a toy shop order", "a pharmacy order", "a bakery order", "a bookshop order", "a sports shop order"]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def _person(i: int) -> dict:
    props = {"name": {"type": "string", "maxLength": 8 + 4 * (i % 5)},
             "age": {"type": "integer", "minimum": 0, "maximum": 120},
             "is_member": {"type": "boolean"}}
    if i % 2:
        props["email"] = {"type": "string", "maxLength": 32}
    if i % 3 == 2:
        props["city"] = {"type": "string", "maxLength": 16}
    return _obj(props)


def _product(i: int) -> dict:
    return _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                 "title": {"type": "string", "maxLength": 16 + 4 * (i % 4)},
                 "price": {"type": "number", "minimum": 0, "maximum": 1000},
                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 1 + i % 3},
                 "in_stock": {"type": "boolean"}})


def _nested(i: int) -> dict:
    props = {"name": {"type": "string", "maxLength": 24},
             "address": _obj({"street": {"type": "string", "maxLength": 28},
                              "city": {"type": "string", "maxLength": 16},
                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
             "owner": _obj({"name": {"type": "string", "maxLength": 16},
                            "years": {"type": "integer", "minimum": 0, "maximum": 99}})}
    if i % 2:
        props["open_on_sunday"] = {"type": "boolean"}
    return _obj(props)


def _ticket(i: int) -> dict:
    statuses = [["open", "closed"], ["new", "triaged", "done"], ["todo", "doing", "review", "done"]][i % 3]
    return _obj({"title": {"type": "string", "maxLength": 24 + 4 * (i % 3)},
                 "status": {"enum": statuses},
                 "priority": {"enum": [1, 2, 3] if i % 2 else ["low", "medium", "high"]},
                 "component": {"enum": ["ui", "api", "db", "infra"][: 2 + i % 3]},
                 "blocking": {"type": "boolean"}})


def _order(i: int) -> dict:
    item = _obj({"name": {"type": "string", "maxLength": 14},
                 "quantity": {"type": "integer", "minimum": 1, "maximum": 20}})
    return _obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                 "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 2 + i % 2},
                 "express": {"type": "boolean"}})


TEMPLATES = [
    ("person", _person, SUBJECTS, "Write a JSON object describing {x}: name, age, membership{extra}."),
    ("product", _product, PRODUCTS, "Write a JSON object for {x} sold in an online shop."),
    ("nested", _nested, PLACES, "Write a JSON object for {x}, with its address and its owner."),
    ("ticket", _ticket, TICKETS, "Write a JSON object for a bug tracker ticket about {x}."),
    ("order", _order, ORDERS, "Write a JSON object for {x} with its items."),
]


def schema_suite(n: int = 50) -> list[tuple[str, str, dict]]:
    """The first ``n`` requests as (id, user message, schema), templates interleaved (any prefix mixes them)."""
    out = []
    for i in range(10):
        for name, make, things, prompt in TEMPLATES:
            schema = make(i)
            extra = "".join(f", {k}" for k in ("email", "city") if k in schema["properties"])
            out.append((f"{name}-{i}", prompt.format(x=things[i], extra=extra) + " Reply with the JSON only.", schema))
    return out[:n]
