"""The tau-bench port: the store's tools as plain functions over a database dict (retail, tau3's mock and telecom
worlds: envs/tau_telecom.py), their JSON schemas, tau2's set-up of a task's initial state and its replay of gold
actions, and the loaders of tau-bench v1 and tau2/tau3 data directories. envs/ecommerce.py's EcommerceEnv runs
episodes on them (tiny worlds and full scale alike).

A refusal raises ToolError, which the environment turns into an "Error: ..." tool message; argument names and types
are checked against the schema before any call. v1 task files are Python, read with `ast` as data, never imported.
"""
import ast
import hashlib
import json
import os
import re

from envs import tau_telecom
from envs.base import (
    ToolError,
    UsageError,
    check_arguments,
    deep_update,
    function_schema,
    json_copy,
    tool_call_text,
    tool_message,
)

# ---------------------------------------------------------------------------------------------------
# Tools: plain functions over the database dict. A refusal raises ToolError, which step() turns into an
# "Error: ..." tool message; argument names and types are checked against the schema before any call.

REASONS = ("no longer needed", "ordered by mistake")


def _get(table, key, what):
    if key not in table:
        raise ToolError(f"{what} not found")
    return table[key]


def _payment(db, user_id, method_id):
    return _get(_get(db["users"], user_id, "user")["payment_methods"], method_id, "payment method")


def _check_items(order, item_ids):
    have = [it["item_id"] for it in order["items"]]
    for i in item_ids:
        if item_ids.count(i) > have.count(i):
            raise ToolError(f"item {i} not found in the order")


def _price_change(db, order, item_ids, new_item_ids):
    """Total price difference of swapping items for variants of the same products (all checked first)."""
    if len(item_ids) != len(new_item_ids) or not item_ids:
        raise ToolError("item_ids and new_item_ids must be non-empty and of the same length")
    _check_items(order, item_ids)
    diff = 0
    for old, new in zip(item_ids, new_item_ids):
        item = next(it for it in order["items"] if it["item_id"] == old)
        variants = _get(db["products"], item["product_id"], "product")["variants"]
        if new == old or new not in variants or not variants[new].get("available", False):
            raise ToolError(f"new item {new} is not an available other option of the same product")
        diff += variants[new]["price"] - item["price"]
    return round(diff, 2)


def find_user_id_by_email(db, email):
    for user_id, user in db["users"].items():
        if user["email"].lower() == email.lower():
            return user_id
    raise ToolError("user not found")


def find_user_id_by_name_zip(db, first_name, last_name, zip):
    for user_id, user in db["users"].items():
        name = user["name"]
        if (name["first_name"].lower(), name["last_name"].lower(), user["address"]["zip"]) == \
                (first_name.lower(), last_name.lower(), zip):
            return user_id
    raise ToolError("user not found")


def get_user_details(db, user_id):
    return _get(db["users"], user_id, "user")


def get_order_details(db, order_id):
    return _get(db["orders"], order_id, "order")


def get_product_details(db, product_id):
    return _get(db["products"], product_id, "product")


def get_item_details(db, item_id):
    for product in db["products"].values():
        if item_id in product["variants"]:
            return product["variants"][item_id]
    raise ToolError("item not found")


def list_all_product_types(db):
    return {p["name"]: p["product_id"] for p in db["products"].values()}


def cancel_pending_order(db, order_id, reason):
    order = _get(db["orders"], order_id, "order")
    if order["status"] != "pending":
        raise ToolError("non-pending order cannot be cancelled")
    if reason not in REASONS:
        raise ToolError("reason must be 'no longer needed' or 'ordered by mistake'")
    methods = [_payment(db, order["user_id"], p["payment_method_id"]) for p in order["payment_history"]]
    refunds = []
    for p, method in zip(order["payment_history"], methods):
        refunds.append({"transaction_type": "refund", "amount": p["amount"], "payment_method_id": p["payment_method_id"]})
        if method["source"] == "gift_card":  # gift cards are refunded at once, other methods in 5-7 days
            method["balance"] = round(method["balance"] + p["amount"], 2)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].extend(refunds)
    return order


def modify_pending_order_address(db, order_id, address1, address2, city, state, country, zip):
    order = _get(db["orders"], order_id, "order")
    if "pending" not in order["status"]:
        raise ToolError("non-pending order cannot be modified")
    order["address"] = {"address1": address1, "address2": address2, "city": city, "state": state,
                        "country": country, "zip": zip}
    return order


def _new_items_charge(db, order, item_ids, new_item_ids, payment_method_id, what):
    """(price difference, payment method) for swapping items, checked like tau-bench: a gift card must
    cover the difference."""
    diff = _price_change(db, order, item_ids, new_item_ids)
    method = _payment(db, order["user_id"], payment_method_id)
    if method["source"] == "gift_card" and method["balance"] < diff:
        raise ToolError(f"insufficient gift card balance to pay for {what}")
    return diff, method


def modify_pending_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    order = _get(db["orders"], order_id, "order")
    if order["status"] != "pending":
        raise ToolError("non-pending order cannot be modified")
    diff, method = _new_items_charge(db, order, item_ids, new_item_ids, payment_method_id, "the new items")
    order["payment_history"].append({"transaction_type": "payment" if diff > 0 else "refund", "amount": abs(diff),
                                     "payment_method_id": payment_method_id})
    if method["source"] == "gift_card":
        method["balance"] = round(method["balance"] - diff, 2)
    for old, new in zip(item_ids, new_item_ids):
        item = next(it for it in order["items"] if it["item_id"] == old)
        variant = db["products"][item["product_id"]]["variants"][new]
        item.update(item_id=new, price=variant["price"], options=variant["options"])
    order["status"] = "pending (item modified)"
    return order


def modify_pending_order_payment(db, order_id, payment_method_id):
    order = _get(db["orders"], order_id, "order")
    if "pending" not in order["status"]:
        raise ToolError("non-pending order cannot be modified")
    history = order["payment_history"]
    if len(history) != 1 or history[0]["transaction_type"] != "payment":
        raise ToolError("there should be exactly one payment for a pending order")
    old_id, amount = history[0]["payment_method_id"], history[0]["amount"]
    if old_id == payment_method_id:
        raise ToolError("the new payment method should be different from the current one")
    new, old = _payment(db, order["user_id"], payment_method_id), _payment(db, order["user_id"], old_id)
    if new["source"] == "gift_card" and new["balance"] < amount:
        raise ToolError("insufficient gift card balance to pay for the order")
    history += [{"transaction_type": "payment", "amount": amount, "payment_method_id": payment_method_id},
                {"transaction_type": "refund", "amount": amount, "payment_method_id": old_id}]
    if new["source"] == "gift_card":
        new["balance"] = round(new["balance"] - amount, 2)
    if old["source"] == "gift_card":
        old["balance"] = round(old["balance"] + amount, 2)
    return order


def modify_user_address(db, user_id, address1, address2, city, state, country, zip):
    user = _get(db["users"], user_id, "user")
    user["address"] = {"address1": address1, "address2": address2, "city": city, "state": state,
                       "country": country, "zip": zip}
    return user


def return_delivered_order_items(db, order_id, item_ids, payment_method_id):
    order = _get(db["orders"], order_id, "order")
    if order["status"] != "delivered":
        raise ToolError("non-delivered order cannot be returned")
    method = _payment(db, order["user_id"], payment_method_id)
    if method["source"] != "gift_card" and payment_method_id != order["payment_history"][0]["payment_method_id"]:
        raise ToolError("the refund must go to the original payment method or a gift card")
    if not item_ids:
        raise ToolError("item_ids must not be empty")
    _check_items(order, item_ids)
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return order


def exchange_delivered_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    order = _get(db["orders"], order_id, "order")
    if order["status"] != "delivered":
        raise ToolError("non-delivered order cannot be exchanged")
    diff, _ = _new_items_charge(db, order, item_ids, new_item_ids, payment_method_id, "the price difference")
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = diff
    return order


def _arith(node):
    """Value of an expression tree made only of numbers, + - * / and unary minus; anything else refuses."""
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _arith(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ToolError("division by zero")
            return a / b
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    raise ToolError("only numbers, + - * / and parentheses are allowed")


def calculate(db, expression):
    # Parsing is not evaluating: ast.parse only builds a tree, and _arith accepts numbers and four
    # operators. The character filter and length cap keep names, calls and deep nesting out entirely.
    if len(expression) > 200 or not re.fullmatch(r"[0-9+\-*/(). ]+", expression):
        raise ToolError("the expression may only contain numbers, + - * / ( ) and spaces (at most 200 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("invalid expression") from None
    try:
        return str(round(float(_arith(tree)), 2))
    except (OverflowError, RecursionError):
        raise ToolError("number too large") from None


def transfer_to_human_agents(db, summary):
    return "Transfer successful"


def think(db, thought):
    return ""


# The telecom store (tiny arena's out-of-domain split): customers, phone lines, plans.

def find_customer_by_phone(db, phone):
    for line in db["lines"].values():
        if line["phone"] == phone:
            return line["customer_id"]
    raise ToolError("customer not found")


def get_customer_details(db, customer_id):
    return _get(db["customers"], customer_id, "customer")


def get_line_details(db, line_id):
    return _get(db["lines"], line_id, "line")


def list_plans(db):
    return {p["name"]: p["plan_id"] for p in db["plans"].values()}


def suspend_line(db, line_id, reason):
    line = _get(db["lines"], line_id, "line")
    if line["status"] != "active":
        raise ToolError("only an active line can be suspended")
    if reason not in ("lost phone", "travel"):
        raise ToolError("reason must be 'lost phone' or 'travel'")
    line.update(status="suspended", suspend_reason=reason)
    return line


def resume_line(db, line_id):
    line = _get(db["lines"], line_id, "line")
    if line["status"] != "suspended":
        raise ToolError("only a suspended line can be resumed")
    line["status"] = "active"
    line.pop("suspend_reason", None)
    return line


def change_plan(db, line_id, plan_id):
    line = _get(db["lines"], line_id, "line")
    _get(db["plans"], plan_id, "plan")
    if line["status"] != "active" or line["plan_id"] == plan_id:
        raise ToolError("the line must be active and the plan different from the current one")
    line["plan_id"] = plan_id
    return line


def add_data(db, line_id, gb):
    line = _get(db["lines"], line_id, "line")
    if not 1 <= gb <= 10:
        raise ToolError("gb must be between 1 and 10")
    line["data_gb"] += gb
    db["customers"][line["customer_id"]]["balance"] += 5 * gb  # data costs $5 per GB, billed to the customer
    return line


# tau3's mock domain (full scale only, out-of-domain): users and their to-do tasks; the user (not the agent) has a
# notification inbox with tools of its own. Ids and fields as tau3's data (db.json, user_db.json), so its tasks'
# gold actions, initial states and assertions apply unchanged.

def create_task(db, user_id, title, description=None):
    user = _get(db["users"], user_id, "user")
    task_id = f"task_{len(db['tasks']) + 1}"
    db["tasks"][task_id] = {"task_id": task_id, "title": title, "description": description, "status": "pending"}
    user["tasks"].append(task_id)
    return db["tasks"][task_id]


def get_users(db):
    return list(db["users"].values())


def update_task_status(db, task_id, status):
    task = _get(db["tasks"], task_id, "task")
    if status not in ("pending", "completed"):
        raise ToolError("status must be 'pending' or 'completed'")
    task["status"] = status
    return task


def check_notifications(db):
    return list(db.get("notifications", {}).values())


def dismiss_notification(db, notification_id):
    _get(db.setdefault("notifications", {}), notification_id, "notification")["status"] = "read"
    return f"Notification {notification_id} dismissed"


# tau3's environment assertions (a task's env_assertions name them): checks of the final databases, never tools
S, SL, INT = {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "integer"}
ASSERTIONS = {
    "assert_number_of_tasks": lambda db, user_id, expected_number:
        len(_get(db["users"], user_id, "user")["tasks"]) == expected_number,
    "assert_task_status": lambda db, task_id, expected_status: _get(db["tasks"], task_id, "task")["status"] == expected_status,
    "assert_notification_status": lambda db, notification_id, expected_status:
        _get(db.get("notifications", {}), notification_id, "notification")["status"] == expected_status,
    **tau_telecom.ASSERTIONS,   # telecom's: the phone (mobile data, speed, MMS, service) and the records
}

ADDRESS = {k: S for k in ("address1", "address2", "city", "state", "country", "zip")}

GENERIC = [
    (calculate, "Calculate an arithmetic expression such as '2 + 2'.", {"expression": S}),
    (transfer_to_human_agents, "Transfer the user to a human agent, with a summary.", {"summary": S}),
    (think, "Think; changes nothing.", {"thought": S}),
]

RETAIL = [
    (find_user_id_by_email, "Find a user id by email.", {"email": S}),
    (find_user_id_by_name_zip, "Find a user id by first name, last name and zip.",
     {"first_name": S, "last_name": S, "zip": S}),
    (get_user_details, "Get a user's details, with their orders.", {"user_id": S}),
    (get_order_details, "Get an order's status and details.", {"order_id": S}),
    (get_product_details, "Get a product's variant items.", {"product_id": S}),
    (get_item_details, "Get an item's details.", {"item_id": S}),
    (list_all_product_types, "List product names and ids.", {}),
    (cancel_pending_order, "Cancel a pending order; reason 'no longer needed' or 'ordered by mistake'.",
     {"order_id": S, "reason": S}),
    (modify_pending_order_address, "Change a pending order's shipping address.", {"order_id": S, **ADDRESS}),
    (modify_pending_order_items, "Swap items of a pending order for other options of the same product.",
     {"order_id": S, "item_ids": SL, "new_item_ids": SL, "payment_method_id": S}),
    (modify_pending_order_payment, "Change a pending order's payment method.", {"order_id": S, "payment_method_id": S}),
    (modify_user_address, "Change a user's default address.", {"user_id": S, **ADDRESS}),
    (return_delivered_order_items, "Return items of a delivered order.",
     {"order_id": S, "item_ids": SL, "payment_method_id": S}),
    (exchange_delivered_order_items, "Exchange items of a delivered order for other options of the same product.",
     {"order_id": S, "item_ids": SL, "new_item_ids": SL, "payment_method_id": S}),
] + GENERIC

TELECOM = [
    (find_customer_by_phone, "Find a customer id by phone number.", {"phone": S}),
    (get_customer_details, "Get a customer's details and line ids.", {"customer_id": S}),
    (get_line_details, "Get a line's phone, plan, status and data.", {"line_id": S}),
    (list_plans, "List plan names and ids.", {}),
    (suspend_line, "Suspend an active line; reason 'lost phone' or 'travel'.", {"line_id": S, "reason": S}),
    (resume_line, "Resume a suspended line.", {"line_id": S}),
    (change_plan, "Move an active line to another plan.", {"line_id": S, "plan_id": S}),
    (add_data, "Add 1-10 GB of data to a line ($5 per GB).", {"line_id": S, "gb": INT}),
] + GENERIC

MOCK = [
    (create_task, "Create a new task for a user.", {"user_id": S, "title": S, "description": S}, ["user_id", "title"]),
    (get_users, "Get every user, with their task ids.", {}),
    (update_task_status, "Set a task's status: 'pending' or 'completed'.", {"task_id": S, "status": S}),
    (transfer_to_human_agents, "Transfer the user to a human agent, with a summary.", {"summary": S}),
]

MOCK_USER = [   # the user's own tools (tau3's dual control), called by the LLM user, on its own database
    (check_notifications, "Check every notification in your inbox.", {}),
    (dismiss_notification, "Dismiss (mark as read) a notification.", {"notification_id": S}),
]


# world -> {tool name: (function, schema)}; "<world>_user": the user's tools there
TOOLS = {world: {fn.__name__: (fn, function_schema(fn.__name__, desc, props, *req)) for fn, desc, props, *req in table}
         for world, table in (("retail", RETAIL), ("telecom", TELECOM), ("mock", MOCK), ("mock_user", MOCK_USER),
                              ("tau_telecom", tau_telecom.TOOLS), ("tau_telecom_user", tau_telecom.USER_TOOLS))}

SCHEMAS = {world: [schema for _, schema in tools.values()] for world, tools in TOOLS.items()}

WRITES = {"cancel_pending_order", "modify_pending_order_address", "modify_pending_order_items",
          "modify_pending_order_payment", "modify_user_address", "return_delivered_order_items",
          "exchange_delivered_order_items", "suspend_line", "resume_line", "change_plan", "add_data", "create_task",
          "update_task_status", "dismiss_notification"} | tau_telecom.WRITES

SYNC = {"tau_telecom": tau_telecom.sync}   # world -> what runs on (db, user db) after every call, as tau2's sync_tools


def sync(world, db, user_db):
    if world in SYNC:
        SYNC[world](db, user_db)


def run_tool(world, db, name, args):
    """(text, ok) of one call on `db` (changed in place for write tools); never raises on model input."""
    if name not in TOOLS.get(world, {}):
        return f"Error: unknown tool {name[:40]!r}", False
    fn, schema = TOOLS[world][name]
    problem = check_arguments(schema, args)
    if problem:
        return f"Error: {problem}", False
    try:
        out = fn(db, **args)
    except ToolError as e:
        return f"Error: {e}", False
    return (out if isinstance(out, str) else json.dumps(out, sort_keys=True, separators=(",", ":"))), True


def db_hash(db) -> str:
    """The canonical fingerprint of a database (key order does not matter)."""
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()


def replay(world, db, actions, user_db=None):
    """The database after running the gold `actions` on a copy of `db` (errors are ignored, as in tau-bench); with
    user_db, (db, user db), the actions whose requestor is the user run on a copy of that."""
    db, udb = json_copy(db), json_copy(user_db or {})
    for a in actions:
        if a["name"] != "transfer_to_human_agents":
            user = a.get("requestor") == "user"
            run_tool(world + "_user" if user else world, udb if user else db, a["name"], a["arguments"])
            sync(world, db, udb)
    return db if user_db is None else (db, udb)


def add_notification(db, notification_id, message, task_id=None):
    """tau3 mock's user-side set-up function (initialization_actions only; not a tool)."""
    db.setdefault("notifications", {})[notification_id] = {"notification_id": notification_id, "message": message,
                                                           "status": "unread", "task_id": task_id}

INIT_ONLY = {"add_notification": add_notification, **tau_telecom.INIT_ONLY}


def initial_dbs(world, db, user_db, gold):
    """(agent db, user db) of a task before its episode, as tau2's set_state makes them: copies of the store with the
    task's initialization data merged in, its initialization actions run, and the tool calls of its message history
    replayed. A set-up that fails is a data error (UsageError), never the policy's."""
    db, user_db = json_copy(db), json_copy(user_db)
    deep_update(db, gold.get("init_data", {}).get("agent_data") or {})
    deep_update(user_db, gold.get("init_data", {}).get("user_data") or {})
    calls = [(c["env"], c["name"], c["arguments"]) for c in gold.get("init_calls", [])]
    calls += [("assistant" if m.get("role") == "assistant" else "user", c.get("name"), c.get("arguments") or {})
              for m in gold.get("history", []) for c in m.get("tool_calls") or []]
    name = "its first sync"
    try:
        sync(world, db, user_db)   # tau2 syncs the two sides when it makes the environment, then after every call
        for env, name, args in calls:
            side, target = (world, db) if env == "assistant" else (world + "_user", user_db)
            if name in INIT_ONLY:
                INIT_ONLY[name](target, **args)
            else:
                text, ok = run_tool(side, target, name, args) if side in TOOLS else (f"no {side} tools", False)
                if not ok:
                    raise ToolError(text)
            sync(world, db, user_db)
    except (ToolError, TypeError, KeyError) as e:
        raise UsageError(f"the initial state of {gold.get('id', 'a task')} fails at {name}: {e}") from None
    return db, user_db


def action_done(action, calls) -> bool:
    """tau2's ACTION check: some call [(name, arguments)] has the gold action's name and its arguments (those in
    compare_args, or every argument the call passed when it has none)."""
    for name, args in calls:
        if name == action["name"]:
            keys = args.keys() if action.get("compare_args") is None else action["compare_args"]
            if {k: v for k, v in args.items() if k in keys} == \
                    {k: v for k, v in action["arguments"].items() if k in keys}:
                return True
    return False


def history_messages(history) -> list:
    """A tau2 message_history as this project's chat messages: assistant tool calls written as the policy writes
    them (<tool_call> blocks), tool results as tool messages; the user's own tool calls are not shown to the agent."""
    out, names = [], {}
    for m in history:
        role, calls = m.get("role"), m.get("tool_calls") or []
        if role == "assistant":
            names.update((c.get("id"), c.get("name")) for c in calls)
            out.append({"role": "assistant", "content": (m.get("content") or "") + "".join(
                tool_call_text(c.get("name"), c.get("arguments") or {}) for c in calls)})
        elif role == "tool" and names.get(m.get("id")):
            out.append(tool_message(names[m.get("id")], m.get("content") or ""))
        elif role == "user" and m.get("content"):
            out.append({"role": "user", "content": m["content"]})
    return out

# ---------------------------------------------------------------------------------------------------
# Full scale: tau-bench v1 / tau2 / tau3 data from a local directory.

DEFAULT_POLICY = ("You are a retail store agent. Authenticate the user by email, or by name and zip, before "
                  "anything else. Check an order's status before acting. List the details of any change and get "
                  "an explicit yes before you make it. Make one tool call at a time. Transfer to a human agent only "
                  "if the request is outside what the tools can do.")


def _read_json(path):
    if not os.path.isfile(path):
        raise UsageError(f"e-commerce data file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise UsageError(f"malformed JSON in {path}: {e}") from None


def load_store(data_dir):
    """(db, policy, world, user_db) of a tau-bench v1 retail directory (users/orders/products.json) or a tau2/tau3
    one (db.json): retail, or tau3's mock domain (tasks and users; the user's inbox in user_db.json)."""
    if not os.path.isdir(data_dir):
        raise UsageError(f"e-commerce data directory not found: {data_dir}")
    tables = {"retail": ("users", "orders", "products"), "mock": ("tasks", "users")}
    if os.path.isfile(os.path.join(data_dir, "db.toml")):
        return load_telecom(data_dir)
    if os.path.isfile(os.path.join(data_dir, "db.json")):
        db = _read_json(os.path.join(data_dir, "db.json"))
    elif all(os.path.isfile(os.path.join(data_dir, t + ".json")) for t in tables["retail"]):
        db = {t: _read_json(os.path.join(data_dir, t + ".json")) for t in tables["retail"]}
    else:
        raise UsageError(f"no retail database in {data_dir}: expected db.json (tau2) or users.json, orders.json, "
                       "products.json (tau-bench v1)")
    world = next((w for w, ts in tables.items() if isinstance(db, dict) and all(isinstance(db.get(t), dict)
                                                                                 for t in ts)), None)
    if world is None:
        raise UsageError(f"the database in {data_dir} must hold users, orders and products (retail) or tasks and "
                         "users (tau3 mock) objects keyed by id")
    db = {t: db[t] for t in tables[world]}
    user_db = _read_json(os.path.join(data_dir, "user_db.json")) if os.path.isfile(os.path.join(data_dir,
                                                                                                 "user_db.json")) else {}
    if not isinstance(user_db, dict):
        raise UsageError(f"malformed {os.path.join(data_dir, 'user_db.json')}: expected an object")
    policy = DEFAULT_POLICY if world == "retail" else None
    for name in ("policy.md", "wiki.md"):
        if os.path.isfile(os.path.join(data_dir, name)):
            with open(os.path.join(data_dir, name), encoding="utf-8") as f:
                policy = f.read().strip()
            break
    if policy is None:
        raise UsageError(f"no policy.md in {data_dir}: the {world} domain's agent policy is part of its data")
    return db, policy, world, user_db


def _read_toml(path):
    import tomllib
    if not os.path.isfile(path):
        raise UsageError(f"telecom data file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"malformed TOML in {path}: {e}") from None


def load_telecom(data_dir):
    """(db, policy, world, user_db) of tau3's telecom directory: the carrier's records (db.toml), the user's phone
    (user_db.toml) and the policy tau2 gives its agent: main_policy.md and the tech-support manual, each in its tags."""
    try:
        db = tau_telecom.load_db(_read_toml(os.path.join(data_dir, "db.toml")))
    except ValueError as e:
        raise UsageError(f"malformed {os.path.join(data_dir, 'db.toml')}: {e}") from None
    user_db = tau_telecom.load_user_db(_read_toml(os.path.join(data_dir, "user_db.toml")))
    parts = []
    for name, tag in (("main_policy.md", "main_policy"), ("tech_support_manual.md", "tech_support_policy")):
        if not os.path.isfile(os.path.join(data_dir, name)):
            raise UsageError(f"no {name} in {data_dir}: the telecom agent's policy is part of its data")
        with open(os.path.join(data_dir, name), encoding="utf-8") as f:
            parts.append(f"<{tag}>\n{f.read().strip()}\n</{tag}>")
    return db, "\n".join(parts), "tau_telecom", user_db


def _py_value(node):
    """A literal from a tau-bench v1 task file: constants, lists, dicts and Task(...)/Action(...) calls
    (read as dicts of their keyword arguments). Anything else is refused; nothing is run."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(x) for x in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Task", "Action")
            and not node.args and all(kw.arg for kw in node.keywords)):
        return {kw.arg: _py_value(kw.value) for kw in node.keywords}
    raise ValueError(f"line {getattr(node, 'lineno', '?')}: {type(node).__name__} is not a literal")


def _read_py_tasks(path):
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise UsageError(f"cannot parse {path}: {e.msg} (line {e.lineno})") from None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.List):
            try:
                return [_py_value(x) for x in node.value.elts]
            except ValueError as e:
                raise UsageError(f"unsupported task in {path}: {e}") from None
    raise UsageError(f"no task list (NAME = [...]) found in {path}")


def _instruction(scenario):
    """tau2's user_scenario as one instruction text for the LLM user."""
    instr = scenario.get("instructions") if isinstance(scenario, dict) else scenario
    if isinstance(instr, dict):
        parts = [f"{k.replace('_', ' ').capitalize()}: {instr[k]}" for k in
                 ("reason_for_call", "known_info", "unknown_info", "task_instructions") if instr.get(k)]
        instr = "\n".join(parts)
    persona = scenario.get("persona") if isinstance(scenario, dict) else None
    return (f"Persona: {persona}\n" if persona else "") + str(instr or "")

REWARD_BASIS = ("DB", "COMMUNICATE")   # tau2's default: the final databases, and every required output said

BASES = {"DB", "COMMUNICATE", "ACTION", "ENV_ASSERTION", "NL_ASSERTION"}


def _tau2_task(r, i, world, where):
    """One tau2/tau3 task row -> this module's task dict; every name it uses is checked against the world's tools."""
    if not isinstance(r, dict):
        raise UsageError(f"malformed task {i} in {where}: expected an object")
    tid, crit, init = str(r.get("id", i)), r.get("evaluation_criteria") or {}, r.get("initial_state") or {}
    # tau2 compares the databases only when a task names gold actions or environment assertions (even empty lists:
    # then nothing may change); with neither, or no evaluation criteria at all, its DB check passes
    db_check = crit.get("actions") is not None or crit.get("env_assertions") is not None
    actions = [{"name": a.get("name"), "arguments": a.get("arguments", {}), "requestor": a.get("requestor", "assistant"),
                "compare_args": a.get("compare_args")} for a in crit.get("actions") or [] if isinstance(a, dict)]
    calls = [{"env": c.get("env_type", "assistant"), "name": c.get("func_name"), "arguments": c.get("arguments", {})}
             for c in init.get("initialization_actions") or [] if isinstance(c, dict)]
    checks = [{"env": c.get("env_type", "assistant"), "name": c.get("func_name"), "arguments": c.get("arguments", {}),
               "expect": c.get("assert_value", True)} for c in crit.get("env_assertions") or [] if isinstance(c, dict)]
    basis = crit.get("reward_basis") or list(REWARD_BASIS)
    if not isinstance(basis, list) or not set(basis) <= BASES:
        raise UsageError(f"task {tid} of {where}: reward_basis must be a list of {', '.join(sorted(BASES))}")
    for what, items, extra in (("initialization call", calls, set(INIT_ONLY)),     # set-up may use INIT_ONLY too
                               ("gold action", [dict(a, env=a["requestor"]) for a in actions], set())):
        for a in items:
            if a["name"] not in set(TOOLS.get(world if a["env"] == "assistant" else world + "_user", {})) | extra \
                    or not isinstance(a["arguments"], dict):
                user = " (user)" * (what == "gold action" and a["env"] == "user")
                raise UsageError(f"task {tid} of {where}: unknown {what}{user} {a['name']!r}")
    for c in checks:
        if c["name"] not in ASSERTIONS or not isinstance(c["arguments"], dict):
            raise UsageError(f"task {tid} of {where}: unknown environment assertion {c['name']!r}")
    history = init.get("message_history") or []
    data = init.get("initialization_data") or {}
    if not isinstance(history, list) or not isinstance(data, dict):
        raise UsageError(f"task {tid} of {where}: malformed initial_state")
    return {"id": tid, "instruction": _instruction(r.get("user_scenario")), "actions": actions,
            "outputs": crit.get("communicate_info") or [], "nl_assertions": crit.get("nl_assertions") or [],
            "env_assertions": checks, "reward_basis": basis, "db_check": db_check, "history": history,
            "init_calls": calls,
            "init_data": {k: data.get(k) or {} for k in ("agent_data", "user_data")}}


def load_tasks(data_dir, split, world="retail"):
    """[{id, instruction, actions: [{name, arguments, ...}], outputs, ...}] of one split of a data directory
    (tau2/tau3 tasks also carry their initial state, assertions and reward basis: _tau2_task)."""
    tau2 = os.path.join(data_dir, "tasks.json")
    if os.path.isfile(tau2):
        rows = _read_json(tau2)
        if not isinstance(rows, list):
            raise UsageError(f"malformed {tau2}: expected a list of tasks")
        split_file = os.path.join(data_dir, "split_tasks.json")
        if os.path.isfile(split_file):
            splits = _read_json(split_file)
            if not isinstance(splits, dict) or split not in splits:
                names = ", ".join(splits) if isinstance(splits, dict) else "none"
                raise UsageError(f"unknown split {split!r} in {split_file}; expected one of {names}")
            keep = {str(i) for i in splits[split]}
            rows = [r for r in rows if isinstance(r, dict) and str(r.get("id")) in keep]
        elif split != "all":
            raise UsageError(f"{data_dir} has no split_tasks.json: use split 'all' or add the file")
        out = [_tau2_task(r, i, world, tau2) for i, r in enumerate(rows)]
    else:
        py, js = (os.path.join(data_dir, f"tasks_{split}.{ext}") for ext in ("py", "json"))
        if os.path.isfile(py):
            rows = _read_py_tasks(py)
        elif os.path.isfile(js):
            rows = _read_json(js)
        else:
            raise UsageError(f"no tasks for split {split!r} in {data_dir}: expected tasks.json (tau2) or "
                           f"tasks_{split}.py / tasks_{split}.json (tau-bench v1)")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise UsageError(f"malformed task file for split {split!r} in {data_dir}: expected a list of tasks")
        out = [{"id": str(i), "instruction": str(r.get("instruction", "")),
                "actions": [{"name": a.get("name"), "arguments": a.get("kwargs", a.get("arguments", {}))}
                            for a in r.get("actions") or [] if isinstance(a, dict)],
                "outputs": r.get("outputs") or []} for i, r in enumerate(rows)]
    for t in out:  # tool names and arguments are tau-bench's own, so gold actions replay unchanged
        t["actions"] = [a for a in t["actions"] if a["name"] != "respond"]  # v1's "talk to the user" action
        for a in t["actions"]:
            if a["name"] not in TOOLS[world] and a.get("requestor") != "user" or not isinstance(a["arguments"], dict):
                raise UsageError(f"task {t['id']} of {data_dir}: unknown gold action {a['name']!r}")
        if not isinstance(t["outputs"], list) or not all(isinstance(o, str) for o in t["outputs"]):
            raise UsageError(f"task {t['id']} of {data_dir}: outputs must be a list of strings")
    return out
