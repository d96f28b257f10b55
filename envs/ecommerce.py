"""E-commerce tool use, modelled on tau-bench retail: a store database, 17 tools, a simulated user,
and tau-bench's reward.

    env = EcommerceEnv()                                   # tiny arena: retail (train/val/test), telecom (ood)
    env = EcommerceEnv(data="data/tau2_retail", user_url="http://localhost:8000/v1", user_model="gpt-4o")

Tiny arena: every task carries its own small store (two users, a few orders, three products) built
from (split, seed). A scripted user states its goal, tells who it is when asked, says "yes" when asked
to confirm, and ends with ###STOP### when the agent stops asking questions. In the tiny arena a write
tool refuses to run until the user has confirmed, so the policy "confirm before any change" matters.
Splits train/val/test are the retail store (users disjoint by split); `ood` is a small telecom store
with other tools and another policy (as tau3's telecom differs from retail).

Full scale: `data=DIR` holds tau-bench v1 retail data (users.json, orders.json, products.json,
tasks_<split>.py or .json, wiki.md) or tau2/tau3 data (db.json, tasks.json, split_tasks.json,
policy.md): the retail domain, or tau3's mock domain (users and their to-do tasks; user_db.json holds the
user's notification inbox, which the user model works with tools of its own), or tau3's telecom domain
(db.toml, user_db.toml: the user operates a simulated phone; envs/tau_telecom.py). tau2 tasks' initial
states (initialization data and actions, a message history whose tool calls are replayed) are set up as
tau2 does. The user is an LLM behind an OpenAI-compatible chat endpoint (`user_url`); v1 task files are
Python, so they are read with `ast` as data and never imported.

Reward (tau-bench): 1 iff the final database equals the initial one with the task's gold actions
replayed on it, every required output string appears in one of the agent's messages, and the episode ended
properly (the user said ###STOP### or the agent transferred; a truncated episode scores 0, as in tau2).
A tau2 task may name other checks in its reward_basis (the product is the reward): ACTION (every gold
action was called with its arguments, the calls in the task's message history included), ENV_ASSERTION
(assertions on the final databases), NL_ASSERTION (judged by the LLM at user_url). As in tau2, a task with
neither gold actions nor environment assertions (or no criteria at all) passes the DB check, and a tau2 episode
ends unfinished (reward 0) once MAX_TOOL_ERRORS tool calls have failed. tests/test_tau2_semantics.py checks these
rules against rewards worked out from tau2's.
Metrics: success, db_match, outputs_ok, tool_calls, tool_errors, turns, user_error.
"""
import ast
import hashlib
import json
import os
import random
import re
import urllib.request

from envs import tau_telecom
from envs.base import (
    SERVICE_ERRORS,
    SPLITS,
    Env,
    Task,
    ToolError,
    UsageError,
    check_arguments,
    deep_update,
    function_schema,
    json_copy,
    parse_tool_calls,
    tool_call_text,
    tool_message,
)

STOP = "###STOP###"
MAX_CALLS_PER_TURN = 8
# tau2's orchestrator ends an episode once this many tool calls (the agent's and the user's) have failed
# (TOO_MANY_ERRORS, reward 0): a tau2/tau3 task does the same here; tau-bench v1 and the tiny arena have no such limit.
MAX_TOOL_ERRORS = 10
REASONS = ("no longer needed", "ordered by mistake")


# ---------------------------------------------------------------------------------------------------
# Tools: plain functions over the database dict. A refusal raises ToolError, which step() turns into an
# "Error: ..." tool message; argument names and types are checked against the schema before any call.

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
ASSERTIONS = {
    "assert_number_of_tasks": lambda db, user_id, expected_number:
        len(_get(db["users"], user_id, "user")["tasks"]) == expected_number,
    "assert_task_status": lambda db, task_id, expected_status: _get(db["tasks"], task_id, "task")["status"] == expected_status,
    "assert_notification_status": lambda db, notification_id, expected_status:
        _get(db.get("notifications", {}), notification_id, "notification")["status"] == expected_status,
    **tau_telecom.ASSERTIONS,   # telecom's: the phone (mobile data, speed, MMS, service) and the records
}


S, SL, INT = {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "integer"}
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
# The tiny arena: one small store per task, generated from (split, seed).

TINY_POLICY = {
    "retail": "You are a retail store agent. Verify the user by email, or name and zip. Check the order. "
              "Ask the user to confirm (yes/no) before any change. Cancel reasons: no longer needed, ordered by mistake.",
    "telecom": "You are a phone company agent. Verify the customer by phone number. Check the line. "
               "Ask the customer to confirm (yes/no) before any change. Suspend reasons: lost phone, travel.",
}
ASK_ID = {"retail": "Sure. What is your email, or your name and zip?", "telecom": "Sure. What is your phone number?"}
ANSWER = {"amount": "You paid {} dollars.", "bill": "You owe {} dollars."}
FIRST = ("Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jay", "Kit", "Lou", "Max", "Ned", "Oda",
         "Pam", "Ray", "Sue", "Tom", "Uma", "Vic", "Wes", "Zoe")
LAST = ("Lee", "Kim", "Diaz", "Ford", "Gray", "Hall", "Khan", "Lopez", "Moss", "Nash", "Park", "Reed", "Shaw",
        "Wood", "Young", "Cruz")
PLACES = (("Ely", "NV"), ("Troy", "NY"), ("Bend", "OR"), ("Waco", "TX"), ("Mesa", "AZ"), ("Erie", "PA"),
          ("Lima", "OH"), ("Provo", "UT"))
STREETS = ("Oak St", "Elm St", "Pine Rd", "Main St", "Lake Ave", "Hill Rd")
PRODUCTS = {"lamp": ("color", ("red", "blue", "green", "black")), "shirt": ("size", ("S", "M", "L", "XL")),
            "mug": ("color", ("white", "red", "blue", "black")), "boots": ("size", ("7", "8", "9", "10")),
            "kettle": ("material", ("steel", "glass", "plastic")), "bag": ("material", ("leather", "canvas", "nylon")),
            "watch": ("strap", ("metal", "leather", "rubber")), "chair": ("color", ("gray", "black", "white"))}
PLANS = (("basic", 20, 5), ("plus", 40, 20), ("max", 60, 50))
# An information task's answer must not be guessable: the tiny arena once asked "How many orders do I have?"
# (1-3), and RL learned to answer without looking (one guess in three wins); an amount paid is 20-198.
RETAIL_KINDS = ("cancel", "address", "return", "exchange", "amount")
TELECOM_KINDS = ("suspend", "resume", "plan", "data", "bill")
# Users' numbers by split (k % 4): train, val and test never share a user, so test is not memorised.
RESIDUES = {"train": (0, 1), "val": (2,), "test": (3,), "ood": (0, 1, 2, 3)}


def _fresh(rng, used, digits=4):
    while True:
        x = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if x not in used:
            used.add(x)
            return x


def _people(rng, split, n):
    """n people (first, last, number) with distinct first names and split-specific numbers."""
    out = []
    for first in rng.sample(FIRST, n):
        k = 4 * rng.randrange(25, 250) + rng.choice(RESIDUES[split])  # 100..999
        out.append((first, rng.choice(LAST), k))
    return out


def _address(rng, used):
    city, state = rng.choice(PLACES)
    return {"address1": f"{rng.randint(1, 99)} {rng.choice(STREETS)}", "address2": "", "city": city,
            "state": state, "country": "USA", "zip": _fresh(rng, used, 5)}


def _act(name, **arguments):
    return {"name": name, "arguments": arguments}


def _retail_task(rng, split, task_id):
    used = set()
    products = {}
    for name in rng.sample(sorted(PRODUCTS), 3):
        key, values = PRODUCTS[name]
        pid = _fresh(rng, used)
        variants = {}
        for value in rng.sample(values, 3):
            iid = _fresh(rng, used)
            variants[iid] = {"item_id": iid, "options": {key: value}, "available": True, "price": rng.randint(10, 99)}
        products[pid] = {"name": name, "product_id": pid, "variants": variants}
    kind = rng.choice(RETAIL_KINDS)
    users, orders = {}, {}
    for j, (first, last, k) in enumerate(_people(rng, split, 2)):
        uid = f"{first}_{last}_{k}".lower()
        source = rng.choice(("credit_card", "gift_card", "paypal"))
        pm = {"source": source, "id": f"{source}_{_fresh(rng, used, 3)}"}
        if source == "gift_card":
            pm["balance"] = rng.randint(100, 300)
        address = _address(rng, used)
        oids = []
        for _ in range(rng.randint(1, 3) if j == 0 else 1):
            oid = "#W" + _fresh(rng, used)
            items = []
            for p in rng.sample(list(products.values()), rng.randint(1, 2)):
                v = rng.choice(list(p["variants"].values()))
                items.append({"item_id": v["item_id"], "product_id": p["product_id"], "name": p["name"],
                              "price": v["price"], "options": dict(v["options"])})
            # Tiny orders leave out the shipping address (tau-bench's orders have one): shorter tool output.
            orders[oid] = {"order_id": oid, "user_id": uid, "status": rng.choice(("pending", "delivered", "processed")),
                           "items": items, "payment_history": [
                               {"transaction_type": "payment", "amount": sum(it["price"] for it in items),
                                "payment_method_id": pm["id"]}]}
            oids.append(oid)
        users[uid] = {"user_id": uid, "name": {"first_name": first, "last_name": last},
                      "email": f"{first}.{last}{k}@x.com".lower(), "address": address,
                      "payment_methods": {pm["id"]: pm}, "orders": oids}
    db = {"users": users, "orders": orders, "products": products}

    uid = next(iter(users))
    user = users[uid]
    if rng.random() < 0.5:
        identity, find = user["email"], _act("find_user_id_by_email", email=user["email"])
    else:
        first, last, zip_ = user["name"]["first_name"], user["name"]["last_name"], user["address"]["zip"]
        identity = f"{first} {last}, zip {zip_}"
        find = _act("find_user_id_by_name_zip", first_name=first, last_name=last, zip=zip_)
    oid = user["orders"][0]
    order = orders[oid]
    other_oid = rng.choice([o for o in orders if o != oid])
    item = rng.choice(order["items"])
    pm_id = order["payment_history"][0]["payment_method_id"]
    outputs, noise = [], {}
    if kind == "amount":   # an information request: the answer is read off the order, never guessable
        goal = f"Tell me what I paid for order {oid}."
        actions = [find, _act("get_order_details", order_id=oid)]
        paid = order["payment_history"][0]["amount"]
        outputs, noise["wrong_arg"] = [str(paid)], str(paid + 10)
    else:
        order["status"] = "pending" if kind in ("cancel", "address") else "delivered"
        actions = [find, _act("get_order_details", order_id=oid)]
        if kind == "cancel":
            reason = rng.choice(REASONS)
            goal = f"Cancel order {oid} please, " + ("I no longer need it." if reason == REASONS[0] else
                                                      "I ordered it by mistake.")
            write = _act("cancel_pending_order", order_id=oid, reason=reason)
            noise["wrong_arg"] = dict(write["arguments"], reason=REASONS[1] if reason == REASONS[0] else REASONS[0])
        elif kind == "address":
            new = _address(rng, used)
            goal = f"Please ship order {oid} to {new['address1']}, {new['city']}, {new['state']} {new['zip']}."
            write = _act("modify_pending_order_address", order_id=oid, **new)
            noise["wrong_arg"] = dict(write["arguments"], zip=new["zip"][:4] + str((int(new["zip"][4]) + 1) % 10))
        elif kind == "return":
            goal = f"Return the {item['name']} in order {oid} please."
            write = _act("return_delivered_order_items", order_id=oid, item_ids=[item["item_id"]], payment_method_id=pm_id)
            others = [i for i in products[item["product_id"]]["variants"] if i != item["item_id"]]
            noise["wrong_arg"] = dict(write["arguments"], item_ids=[rng.choice(others)])
        else:  # exchange for another option of the same product
            product = products[item["product_id"]]
            new_iid, wrong_iid = rng.sample([i for i in product["variants"] if i != item["item_id"]], 2)
            (key, value), = product["variants"][new_iid]["options"].items()
            goal = f"Exchange the {item['name']} in order {oid} for {key} {value}."
            actions.append(_act("get_product_details", product_id=product["product_id"]))
            write = _act("exchange_delivered_order_items", order_id=oid, item_ids=[item["item_id"]],
                         new_item_ids=[new_iid], payment_method_id=pm_id)
            noise["wrong_arg"] = dict(write["arguments"], new_item_ids=[wrong_iid])
        noise["wrong_order"] = dict(write["arguments"], order_id=other_oid)
        actions.append(write)
    return _tiny_task(task_id, split, "retail", kind, db, actions, outputs, goal, identity, noise)


def _telecom_task(rng, split, task_id):
    used = set()
    plans = {}
    for name, price, gb in PLANS:
        pid = _fresh(rng, used)
        plans[pid] = {"plan_id": pid, "name": name, "price": price, "data_gb": gb}
    kind = rng.choice(TELECOM_KINDS)
    customers, lines = {}, {}
    for first, last, k in _people(rng, split, 2):
        cid = f"{first}_{last}_{k}".lower()
        lids = []
        for _ in range(rng.randint(1, 2)):
            lid = "L" + _fresh(rng, used)
            lines[lid] = {"line_id": lid, "customer_id": cid, "phone": "555-" + _fresh(rng, used),
                          "plan_id": rng.choice(sorted(plans)), "status": rng.choice(("active", "suspended")),
                          "data_gb": rng.randint(0, 9)}
            lids.append(lid)
        customers[cid] = {"customer_id": cid, "name": f"{first} {last}", "balance": rng.choice((0, rng.randint(5, 99))),
                          "line_ids": lids}
    db = {"customers": customers, "lines": lines, "plans": plans}

    cid = next(iter(customers))
    lids = customers[cid]["line_ids"]
    lid = rng.choice(lids)
    line = lines[lid]
    other_lid = rng.choice([x for x in lines if x != lid])
    identity = line["phone"]
    actions = [_act("find_customer_by_phone", phone=line["phone"]), _act("get_customer_details", customer_id=cid)]
    outputs, noise = [], {}
    if kind == "bill":
        customers[cid]["balance"] = rng.randint(5, 99)
        goal = "Tell me what I owe."
        outputs = [str(customers[cid]["balance"])]
        noise["wrong_arg"] = str(customers[cid]["balance"] + 1)  # n+1 never contains n as a substring
    else:
        # The agent learns which of the customer's lines is the caller's by looking at them in order.
        actions += [_act("get_line_details", line_id=x) for x in lids[:lids.index(lid) + 1]]
        line["status"] = "suspended" if kind == "resume" else "active"
        if kind == "suspend":
            reason = rng.choice(("lost phone", "travel"))
            goal = "Please suspend my line, " + ("I lost my phone." if reason == "lost phone" else "I am going to travel.")
            write = _act("suspend_line", line_id=lid, reason=reason)
            noise["wrong_arg"] = dict(write["arguments"], reason="travel" if reason == "lost phone" else "lost phone")
        elif kind == "resume":
            goal = "Please resume my line."
            write = _act("resume_line", line_id=lid)
            noise["wrong_arg"] = dict(write["arguments"], line_id="L" + _fresh(rng, used))
        elif kind == "plan":
            new_pid, wrong_pid = rng.sample(sorted(p for p in plans if p != line["plan_id"]), 2)
            goal = f"Switch my line to the {plans[new_pid]['name']} plan."
            actions.append(_act("list_plans"))
            write = _act("change_plan", line_id=lid, plan_id=new_pid)
            noise["wrong_arg"] = dict(write["arguments"], plan_id=wrong_pid)
        else:
            gb = rng.randint(1, 5)
            goal = f"Add {gb} GB of data to my line."
            write = _act("add_data", line_id=lid, gb=gb)
            noise["wrong_arg"] = dict(write["arguments"], gb=gb + 1)
        noise["wrong_order"] = dict(write["arguments"], line_id=other_lid)
        actions.append(write)
    return _tiny_task(task_id, split, "telecom", kind, db, actions, outputs, goal, identity, noise)


def _tiny_task(task_id, split, world, kind, db, actions, outputs, goal, identity, noise):
    """gold: the initial db, the gold actions and required outputs (the reward), the scripted user's
    lines, and `noise`: mistaken write arguments that demos() uses for its deliberately wrong episodes."""
    return Task(id=task_id, env="ecommerce", split=split, tools=SCHEMAS[world],
                messages=[{"role": "system", "content": TINY_POLICY[world]}, {"role": "user", "content": goal}],
                gold={"world": world, "kind": kind, "db": db, "actions": actions, "outputs": outputs,
                      "user": {"goal": goal, "identity": identity},
                      "instruction": f"{goal} If asked who you are, say: {identity}.", "noise": noise})


def expert_turns(task, mistake=None):
    """The assistant texts of a by-the-book episode for a tiny task (ask identity, look up, confirm, act,
    tell the user), or of one with a `mistake`: wrong_arg, wrong_order, no_confirm or no_action.
    A turn that speaks to the user opens with "Re: <the user's request>", as a support agent restates a
    ticket. For a small model this is what makes the request reachable when it decides: the first turn
    copies it from the message just above, and the deciding turn, hundreds of tokens later, copies it
    from "Re:" on (an induction copy, the skill the tiny base is drilled in) before it writes the
    confirmation or the answer right after it (without it the tiny base chose the action regardless of
    the request)."""
    g = task.gold
    actions = g["actions"]
    write = actions[-1] if actions[-1]["name"] in WRITES else None
    reads = actions[:-1] if write else actions
    restate = f"Re: {g['user']['goal']}\n"
    texts = [restate + ASK_ID[g["world"]]] + [tool_call_text(a["name"], a["arguments"]) for a in reads]
    if write is None:  # an information request: answer with the required output
        wrong = mistake == "wrong_arg"
        return texts + [restate + ANSWER[g["kind"]].format(g["noise"]["wrong_arg"] if wrong else g["outputs"][0])]
    args = g["noise"][mistake] if mistake in ("wrong_arg", "wrong_order") else write["arguments"]
    if mistake != "no_confirm":
        shown = [", ".join(v) if isinstance(v, list) else str(v) for v in args.values()]
        texts.append(restate + f"Please confirm (yes/no): {write['name']} {', '.join(s for s in shown if s)}.")
    if mistake != "no_action":
        texts.append(tool_call_text(write["name"], args))
    return texts + ["Done."]


def play(env, task, texts):
    """Drive one episode with fixed assistant `texts` (until the episode ends); returns the state."""
    state = env.reset(task)
    for text in texts:
        if state.done:
            break
        env.step(state, text)
    return state


# ---------------------------------------------------------------------------------------------------
# Full scale: tau-bench v1 / tau2 retail data from a local directory.

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


# ---------------------------------------------------------------------------------------------------
# The simulated users.

ID_WORDS = ("email", "zip", "name", "phone", "verify", "identif")
# The LLM user's system prompt: guidelines for its domain, then the task's scenario. tau2 gives its user simulator
# guidelines of its own (one set for a user who only talks, one for a user with tools of their own); these say the
# same things in this project's words, with each domain's setting.
USER_CORE = (
    "You play a customer who has contacted a support agent. Follow the scenario below and stay in character.\n"
    "- Write one short, natural message per turn.\n"
    "- Say only what the scenario gives you: anything it does not give, you do not know; never make it up.\n"
    "- Give details only when the agent asks for them, a little at a time, and in your own words: never paste the "
    "scenario.\n")
USER_WITH_TOOLS = (
    "- You have tools of your own, on your side of the conversation. In a turn, either call one tool or write to the "
    "agent, never both; the agent does not see your tool calls, only your messages.\n"
    "- Use a tool only when the agent asks you to do or check something, or to answer the agent's question; when "
    "unsure what to do, ask. If the agent asks for several actions at once, say you can do one at a time and ask "
    "which comes first.\n"
    "- Report what a tool actually returned; never invent a result. If a call fails, correct it and try again.\n")
USER_END = (f"- When your goal is reached, when you have been transferred to another agent, or when the scenario "
            f"leaves you nothing more to say, reply with {STOP} alone.\n")
USER_GUIDELINES = {
    "retail": "You are shopping with an online store and need help with an order or your account.\n" + USER_CORE
              + USER_END,
    "mock": "You use a task-tracking service and need help with your tasks. Your own tools show your notifications "
            "inbox.\n" + USER_CORE + USER_WITH_TOOLS + USER_END,
    "tau_telecom": "You are a mobile phone customer with a problem on your phone or your account, and not a technical "
                   "person. Your own tools operate your phone: the agent cannot see it, so when asked, check or "
                   "change a setting and describe what you see.\n" + USER_CORE + USER_WITH_TOOLS + USER_END,
}


def user_system(world, instruction) -> str:
    """The LLM user's system prompt for a world (retail's guidelines where a world has none of its own)."""
    return f"{USER_GUIDELINES.get(world, USER_GUIDELINES['retail'])}\n<scenario>\n{instruction}\n</scenario>"


def scripted_reply(info, user, text):
    """The tiny arena's user: tells who it is when asked, says yes when asked to confirm, and stops once
    a change was made or the agent stops asking (after restating its goal at most twice)."""
    t = text.lower()
    asks_id = any(w in t for w in ID_WORDS)
    if asks_id and not info["revealed"]:
        info["revealed"] = True
        return user["identity"]
    if "confirm" in t or "yes/no" in t:
        info["confirmed"] = True
        return "yes"
    if asks_id:
        return user["identity"]
    if info["writes"] or "?" not in t or info["restated"] >= 2:
        return STOP
    info["restated"] += 1
    return user["goal"]


def spoken(content) -> str:
    """A message's words to the other party: its <tool_call> blocks (an unterminated last one too) taken out."""
    return re.sub(r"<tool_call>.*?(</tool_call>|$)", " ", str(content or ""), flags=re.DOTALL)


def said_output(output: str, said: str, tiny: bool) -> bool:
    """Does one assistant message (`said`: lower case, commas taken out) say a required output? tau-bench's rule is
    a substring test, kept for real tasks: the output is only lower-cased, so one with a comma in it is never found,
    as in tau-bench and tau2. A tiny task's outputs are numbers, which a substring test finds in any text with
    digits in it ("zip 236" says 2 and 3): the tiny policy learned to win the (since replaced) order-count tasks
    that way. There a numeric output must appear as a whole number."""
    output = output.lower()
    if tiny and re.fullmatch(r"\d+(\.\d+)?", output):
        return re.search(r"(?<![\d.])" + re.escape(output) + r"(?![\d]|\.\d)", said) is not None
    return output in said


class _Refuse(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None   # urllib then raises the 3xx as an HTTPError


# The user model's calls carry its key: a redirect is refused, never followed (urllib would resend the Authorization
# header to wherever the Location points, another host or plain http).
NO_REDIRECTS = urllib.request.build_opener(_Refuse)


class EcommerceEnv(Env):
    """Retail (tau-bench style) tool use with a simulated user; tiny arena by default, real data with `data`.

    data: a tau-bench v1 or tau2/tau3 retail directory (None: the tiny arena).
    user_url: an OpenAI-compatible endpoint (e.g. http://host:8000/v1) for the LLM user; required with
        `data`; None means the tiny arena's scripted user.
    user_model, user_api_key_env, user_timeout: the user model's name, the environment variable that holds
        its API key (None: no key is sent; a key goes only where it is named, and a warning is printed when it
        would travel over plain http to another machine), and the HTTP timeout in seconds.
    max_turns: assistant turns per episode (default 10 tiny, 30 full, as tau-bench's 30 steps; telecom 100: its
        troubleshooting takes many turns, and tau2 allows 200 messages of every role).
    workers: with user_url, how many episodes' resets and turns the rollout loop runs at once (threads)."""
    domain = "ecommerce"

    def __init__(self, data=None, user_url=None, user_model="gpt-4o", user_api_key_env=None,
                 user_timeout=60.0, max_turns=None, workers=1):
        if data is not None and not user_url:
            raise UsageError("real e-commerce data needs an LLM user: pass user_url (an OpenAI-compatible endpoint)")
        if user_api_key_env and not os.environ.get(user_api_key_env):
            raise UsageError(f"the user model's key variable {user_api_key_env} is not set")
        if user_api_key_env and user_url:
            from urllib.parse import urlparse
            u = urlparse(user_url)
            if u.scheme == "http" and u.hostname not in ("localhost", "127.0.0.1", "::1"):
                raise UsageError(f"the key in {user_api_key_env} would go to {u.hostname} over plain http: use https, "
                                 f"or a loopback address")
        self.data, self.user_url, self.user_model = data, user_url, user_model
        self.user_api_key_env, self.user_timeout = user_api_key_env, user_timeout
        self.workers = max(1, workers) if user_url else 1   # episodes' user turns at once (the rollout loop's env_calls)
        self.db, self.policy, self.world, self.user_db = load_store(data) if data is not None else (None, None,
                                                                                                   "retail", {})
        self.max_turns = max_turns or (10 if data is None else 100 if self.world == "tau_telecom" else 30)
        self._gold_hash = {}  # task id -> (target hashes, its own initial dbs or None): the store set up once per task

    def tasks(self, split, n=None, seed=0):
        if self.data is not None:
            rows = load_tasks(self.data, split, self.world)[:n]
            return [Task(id=f"ecommerce-{split}-{r['id']}", env="ecommerce", split=split, tools=SCHEMAS[self.world],
                         messages=[{"role": "system", "content": self.policy}] + history_messages(r.get("history", [])),
                         gold={"world": self.world, "kind": "real", **r}) for r in rows]
        if split not in SPLITS:
            raise UsageError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        n = (5000 if split == "train" else 300) if n is None else n
        make = _telecom_task if split == "ood" else _retail_task
        return [make(random.Random(f"ecommerce-{split}-{seed}-{i}"), split, f"ecommerce-{split}-{seed}-{i}")
                for i in range(n)]

    def reset(self, task):
        state = super().reset(task)
        g = task.gold
        if g.get("db") is None and self.db is None:
            raise UsageError(f"task {task.id} has no database: real-data tasks need EcommerceEnv(data=...)")
        db, user_db = (g["db"], {}) if g.get("db") is not None else (self.db, self.user_db)
        if g.get("db") is None and task.id in self._gold_hash:
            target, own = self._gold_hash[task.id]
        else:   # a task's own initial state (tau2's initialization data and actions, its history's calls); gold replayed
            own = initial_dbs(g["world"], db, user_db, g) if g.get("init_calls") or any(
                g.get("init_data", {}).values()) or any(m.get("tool_calls") for m in g.get("history", [])) else None
            start = own or (db, user_db)
            target = tuple(db_hash(x) for x in replay(g["world"], start[0], g["actions"], start[1]))
            if g.get("db") is None:   # (the store itself is kept once, not per task)
                self._gold_hash[task.id] = target, own
        db, user_db = own or (db, user_db)
        # tau2's ACTION check looks at the whole trajectory: the calls in the task's message history count too
        history_calls = [(c.get("name"), c.get("arguments") or {}) for m in g.get("history", [])
                         if m.get("role") in ("assistant", "user") for c in m.get("tool_calls") or []]
        state.info.update(world=g["world"], db=json_copy(db), user_db=json_copy(user_db), target=target, ended="",
                          revealed=False, confirmed=False, restated=0, writes=0, tool_calls=0, tool_errors=0,
                          user_tool_errors=0, user_error=0.0, calls=history_calls)
        if self.user_url:  # the LLM user plays the customer; roles are swapped in its own transcript
            chat = [{"role": "system", "content": user_system(g["world"], g.get("instruction", ""))},
                    {"role": "user", "content": "Hi! How can I help you today?"}]
            state.info["user_chat"] = chat
            for m in state.messages:   # a task's message history: the user said what the agent was told, and v.v.
                text = spoken(m.get("content")).strip()
                if m["role"] in ("user", "assistant") and text:
                    chat.append({"role": "assistant" if m["role"] == "user" else "user", "content": text})
            if not state.messages or state.messages[-1]["role"] != "user":   # else the agent speaks next
                opening = self._llm_turn(state)
                state.messages.append({"role": "user", "content": opening})
                if STOP in opening:
                    state.done = True
                    state.info["ended"] = state.info["ended"] or "user_stop"
        return state

    def step(self, state, text):
        text = text if isinstance(text, str) else ""
        info = state.info
        state.messages.append({"role": "assistant", "content": text})
        state.turns += 1
        calls, errors = parse_tool_calls(text)
        obs = []
        if calls or errors:  # a turn with tool calls goes to the tools, not to the user
            for err in errors:
                obs.append(tool_message("error", f"Error: {err}"))
            for name, args in calls[:MAX_CALLS_PER_TURN]:
                obs.append(self._call(state, name, args))
            if len(calls) > MAX_CALLS_PER_TURN:
                obs.append(tool_message("error", f"Error: at most {MAX_CALLS_PER_TURN} tool calls per turn"))
            info["tool_errors"] += len(errors) + (len(calls) > MAX_CALLS_PER_TURN)
            state.done = info["ended"] == "transfer" or self._too_many_errors(state)
        else:
            reply = self._llm_reply(state, text) if self.user_url else scripted_reply(info, state.task.gold["user"], text)
            obs.append({"role": "user", "content": reply})
            if STOP in reply:
                state.done = True
                info["ended"] = info["ended"] or "user_stop"
        if state.turns >= self.max_turns:
            state.done = True
        state.messages.extend(obs)
        return obs

    @staticmethod
    def _too_many_errors(state) -> bool:
        """tau2's TOO_MANY_ERRORS (tau2/tau3 tasks only): once MAX_TOOL_ERRORS calls of the agent and the user have
        failed, the episode ends, unfinished (reward 0)."""
        info = state.info
        if "reward_basis" not in state.task.gold or info["tool_errors"] + info["user_tool_errors"] < MAX_TOOL_ERRORS:
            return False
        info["ended"] = "too_many_errors"   # (over a transfer in the same turn too: tau2 checks errors first)
        return True

    def _call(self, state, name, args):
        info = state.info
        info["tool_calls"] += 1
        info["calls"].append((name, args))   # every call the agent made, for tau2's ACTION check
        if name in WRITES and not self.user_url and not info["confirmed"] and name in TOOLS[info["world"]]:
            text, ok = "Error: ask the user to confirm (yes/no) before this change", False
        else:
            text, ok = run_tool(info["world"], info["db"], name, args)
            sync(info["world"], info["db"], info["user_db"])
        if ok and name in WRITES:
            info["writes"] += 1
            info["confirmed"] = False  # one yes allows one change
        if ok and name == "transfer_to_human_agents":
            info["ended"] = "transfer"
        info["tool_errors"] += not ok
        # Model-written strings echo back in results; escape lone surrogates so any tokenizer can encode them.
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        return tool_message(re.sub(r"[^A-Za-z0-9_]", "", name)[:64] or "error", text)

    def _chat(self, chat: list, max_tokens: int | None = None, tools: list | None = None) -> tuple:
        """One request to the LLM user's endpoint -> (its reply, reasoning removed; its tool calls, OpenAI format, when
        `tools` were offered). Qwen3 user models are asked not to think (chat_template_kwargs, as the released code
        does; other servers are not sent the field). Raises what the HTTP call or a malformed answer raises."""
        url = self.user_url.rstrip("/")
        url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.user_api_key_env, "") if self.user_api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = {"model": self.user_model, "messages": chat, "temperature": 0.0}
        if "qwen3" in self.user_model.lower():
            request["chat_template_kwargs"] = {"enable_thinking": False}
        if max_tokens:
            request["max_tokens"] = max_tokens
        if tools:
            request["tools"] = tools
        with NO_REDIRECTS.open(urllib.request.Request(url, data=json.dumps(request).encode(), headers=headers),
                               timeout=self.user_timeout) as r:
            message = json.loads(r.read())["choices"][0]["message"]
        reply, calls = message.get("content"), (message.get("tool_calls") or []) if tools else []
        if not isinstance(reply, str) and not (calls and reply is None):
            raise TypeError("no text in the user model's reply")
        if not isinstance(calls, list):
            raise TypeError("malformed tool calls in the user model's reply")
        reply = reply or ""
        # a reasoning model's thoughts are not what the user says: drop <think>...</think> (and a reply whose
        # opening tag the template already wrote, so that only the closing one is left)
        reply = re.sub(r"<think>.*?</think>", "", reply, flags=re.DOTALL)
        return reply.split("</think>")[-1].strip(), calls

    def check_services(self):
        """One probe request to the LLM user (a user model that cannot answer would end every episode in a user
        error, reward 0)."""
        if not self.user_url:
            return
        try:
            self._chat([{"role": "user", "content": "Reply with the word ok."}], max_tokens=16)   # (text, no tools)
        except SERVICE_ERRORS as e:
            raise UsageError(f"the user model {self.user_model!r} at {self.user_url} does not answer a probe "
                             f"({type(e).__name__}: {str(e)[:200]}): start it, or fix --user-url/--user-model") from None

    def _llm_turn(self, state):
        """The LLM user's next message; a failed call ends the episode (user_error=1) instead of raising. Where the
        user has tools of its own (tau3's dual control: mock's inbox), they are offered to the user model, and its
        calls run on the user's database (a malformed one gets an error result) until it writes a message, at most
        MAX_CALLS_PER_TURN rounds."""
        info, chat = state.info, state.info["user_chat"]
        tools = SCHEMAS.get(info["world"] + "_user")
        try:
            for _ in range(MAX_CALLS_PER_TURN):
                reply, calls = self._chat(chat, tools=tools)
                if not calls:
                    break
                chat.append({"role": "assistant", "content": reply or None, "tool_calls": calls})
                for c in calls:
                    fn = c.get("function") if isinstance(c, dict) else None
                    fn = fn if isinstance(fn, dict) else {}
                    try:
                        args = json.loads(fn.get("arguments") or "{}")
                    except ValueError:
                        args = None
                    name = str(fn.get("name"))
                    text, ok = run_tool(info["world"] + "_user", info["user_db"], name, args) \
                        if isinstance(args, dict) else ("Error: the arguments are not a JSON object", False)
                    sync(info["world"], info["db"], info["user_db"])
                    info["calls"].append((name, args if isinstance(args, dict) else {}))
                    info["user_tool_errors"] += not ok
                    chat.append({"role": "tool", "tool_call_id": c.get("id") if isinstance(c, dict) else None,
                                 "content": text})
                if self._too_many_errors(state):   # (its step() then ends the episode on this STOP)
                    return STOP
        except SERVICE_ERRORS:
            reply = ""
        if not reply:
            info["user_error"] = 1.0
            info["ended"] = "user_error"
            return STOP
        chat.append({"role": "assistant", "content": reply})
        return reply

    def _llm_reply(self, state, text):
        state.info["user_chat"].append({"role": "user", "content": text})
        return self._llm_turn(state)

    def score(self, state):
        info = state.info
        if "db" not in info:  # never reset: nothing happened
            return 0.0, {k: 0.0 for k in ("success", "db_match", "outputs_ok", "tool_calls", "tool_errors",
                                          "turns", "user_error")}
        g = state.task.gold
        db_match = not g.get("db_check", True) or \
            (db_hash(info["db"]), db_hash(info.get("user_db", {}))) == info["target"]
        # tau-bench and tau2 look for each required output in one assistant message at a time (the task's message
        # history included), with that message's commas taken out (thousands separators)
        said = [spoken(m.get("content")).lower().replace(",", "") for m in state.messages
                if m.get("role") == "assistant"]
        outputs_ok = all(any(said_output(o, s, tiny=g["kind"] != "real") for s in said) for o in g["outputs"])
        finished = info["ended"] in ("user_stop", "transfer") and not state.truncated
        # tau2's reward: the product of the checks its reward_basis names (default: the databases, the outputs)
        checks = {"DB": lambda: db_match, "COMMUNICATE": lambda: outputs_ok,
                  "ACTION": lambda: all(action_done(a, info["calls"]) for a in g["actions"]),
                  "ENV_ASSERTION": lambda: all(self._asserts(info, c) for c in g.get("env_assertions", [])),
                  "NL_ASSERTION": lambda: self._judge(state, g.get("nl_assertions", []))}
        success = float(finished and all(checks[b]() for b in g.get("reward_basis", REWARD_BASIS)))
        return success, {"success": success, "db_match": float(db_match), "outputs_ok": float(outputs_ok),
                         "tool_calls": float(info["tool_calls"]), "tool_errors": float(info["tool_errors"]),
                         "turns": float(state.turns), "user_error": float(info["user_error"])}

    @staticmethod
    def _asserts(info, check) -> bool:
        """One tau2 environment assertion on the final agent (or user) database holds its expected value."""
        db = info["db"] if check["env"] == "assistant" else info["user_db"]
        try:
            return ASSERTIONS[check["name"]](db, **check["arguments"]) == check["expect"]
        except (ToolError, TypeError, KeyError):
            return False

    def _judge(self, state, assertions) -> bool:
        """tau2's NL_ASSERTION check, by the LLM at user_url as the judge: does the conversation satisfy every
        assertion? A judge that fails or answers out of format counts as no."""
        if not assertions:
            return True
        # the whole trajectory, as tau2's judge reads it: the task's message history and the tool results too
        talk = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in state.messages
                         if m.get("role") in ("user", "assistant", "tool"))
        ask = ("Here is a conversation between a customer (user) and a support agent (assistant):\n" + talk +
               "\n\nFor each numbered assertion, decide whether the conversation satisfies it:\n" +
               "\n".join(f"{i + 1}. {a}" for i, a in enumerate(assertions)) +
               "\n\nReply with only a JSON list of true/false values, one per assertion, in order.")
        try:
            reply, _ = self._chat([{"role": "user", "content": ask}])
            verdict = json.loads(reply[reply.index("["): reply.rindex("]") + 1])
        except SERVICE_ERRORS:
            return False
        return isinstance(verdict, list) and len(verdict) == len(assertions) and all(v is True for v in verdict)

    def compliant(self, state):
        """By the book: every write comes after the user said yes to a confirmation the agent asked for since the
        previous write (one yes, one change), and the episode ended properly (the user stopped, or the agent
        transferred to a human), not cut at a limit."""
        if state.truncated:
            return False
        asked = confirmed = ended = False
        for m in state.messages[len(state.task.messages):]:
            text = str(m.get("content") or "")
            if m.get("role") == "assistant":
                calls, _ = parse_tool_calls(text)
                if not calls:
                    asked = "confirm" in text.lower() or "yes/no" in text.lower()
                for name, _ in calls:
                    if name in WRITES:
                        if not confirmed:
                            return False
                        confirmed = False
                    ended = ended or name == "transfer_to_human_agents"
            elif m.get("role") == "user":
                confirmed = confirmed or (asked and re.match(r"\s*yes\b", text.lower()) is not None)
                asked, ended = False, ended or STOP in text
        return ended

    def expert(self, task):
        return expert_turns(task) if task.gold.get("kind") not in (None, "real") else None

    def demos(self, n, seed=0, noise=0.5):
        """Scripted retail episodes from the train distribution; a `noise` fraction makes one mistake (a
        wrong order or argument, a skipped confirmation, or no action at all; a wrong amount)."""
        env = EcommerceEnv()  # always the scripted user, whatever this env was built with
        out = []
        for i in range(n):
            rng = random.Random(f"ecommerce-demo-{seed}-{i}")
            task = _retail_task(rng, "train", f"ecommerce-demo-{seed}-{i}")
            mistake = None
            if rng.random() < noise:
                mistake = "wrong_arg" if task.gold["kind"] == "amount" else \
                    rng.choice(("wrong_arg", "wrong_order", "no_confirm", "no_action"))
            state = play(env, task, expert_turns(task, mistake))
            out.append({"messages": state.messages, "tools": task.tools})
        return out
