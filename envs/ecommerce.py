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

This file holds the tiny worlds, the users and the environment; the store's tools, tau2's set-up and replay and the
data loaders (the tau-bench port) are envs/tau_store.py.
"""
import json
import os
import random
import re
import urllib.request

from envs.base import (
    SERVICE_ERRORS,
    SPLITS,
    Env,
    Task,
    ToolError,
    UsageError,
    json_copy,
    parse_tool_calls,
    tool_call_text,
    tool_message,
)
from envs.tau_store import (
    ASSERTIONS,
    REASONS,
    REWARD_BASIS,
    SCHEMAS,
    TOOLS,
    WRITES,
    action_done,
    db_hash,
    history_messages,
    initial_dbs,
    load_store,
    load_tasks,
    replay,
    run_tool,
    sync,
)

STOP = "###STOP###"
MAX_CALLS_PER_TURN = 8
# tau2's orchestrator ends an episode once this many tool calls (the agent's and the user's) have failed
# (TOO_MANY_ERRORS, reward 0): a tau2/tau3 task does the same here; tau-bench v1 and the tiny arena have no such limit.
MAX_TOOL_ERRORS = 10



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
    lines, and `noise`: mistaken write arguments, for expert_turns' mistaken episodes (the reward tests)."""
    return Task(id=task_id, env="ecommerce", split=split, tools=SCHEMAS[world],
                messages=[{"role": "system", "content": TINY_POLICY[world]}, {"role": "user", "content": goal}],
                gold={"world": world, "kind": kind, "db": db, "actions": actions, "outputs": outputs,
                      "user": {"goal": goal, "identity": identity},
                      "instruction": f"{goal} If asked who you are, say: {identity}.", "noise": noise})


def confirmation(name, args) -> str:
    """What the expert asks before a change: "Please confirm (yes/no): cancel_pending_order #W1234, no longer needed."."""
    shown = [", ".join(v) if isinstance(v, list) else str(v) for v in args.values()]
    return f"Please confirm (yes/no): {name} {', '.join(s for s in shown if s)}."


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
        texts.append(restate + confirmation(write["name"], args))
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
# The base's pre-training text (EcommerceEnv.knowledge): the two stores' policy, records and worked cases in plain
# prose, never the protocol (chat turns, tool calls: the stage's cold start teaches them). Tools are named in words,
# as a manual names them; records are shown in prose or as the exact JSON a tool returns (data the agent must read).

KNOWLEDGE_KINDS = ("policy", "records", "case")
RETAIL_POLICY = (   # (topic, wordings), in the order an episode meets them; {oid} and the like: an example's values
    ("verify", (
        "Every request starts with the user's identity. The agent asks for the user's email, or for their first name, "
        "last name and zip code, and looks up the user id: by email with find_user_id_by_email, or by name and zip "
        "with find_user_id_by_name_zip. A user id looks like {uid}.",
        "First the agent authenticates the user, even when the user has already named an order. An email address "
        "finds the user id through find_user_id_by_email; a first name, a last name and a zip code find it through "
        "find_user_id_by_name_zip. When nobody matches, the lookup says user not found.",
        "The agent never acts for a user it has not verified. It asks for the email, or the name and zip. With the "
        "email it looks the user up by email (find_user_id_by_email); with the name and zip it looks the user up by "
        "name and zip (find_user_id_by_name_zip). Either lookup returns the user id, such as {uid}.")),
    ("order", (
        "Next the agent checks the order the user names. get_order_details takes the order id, which starts with #W, "
        "and returns the order's record: its status (pending, processed or delivered), its items, each with an item "
        "id, a product id, a name, options and a price, and its payment history with the amount paid and the payment "
        "method id.",
        "The agent reads an order before it does anything with it: get_order_details with the order id, such as {oid}. "
        "The record says whether the order is pending, processed or delivered, lists the items with their item ids "
        "and prices, and shows the payment: the amount and the payment method.",
        "An order is checked with get_order_details. Its status decides what may be done: a pending order can be "
        "cancelled or sent to a new address, a delivered order's items can be returned or exchanged, and a processed "
        "order can be neither. get_user_details shows a user's profile: name, email, address, payment methods and "
        "order ids.")),
    ("confirm", (
        "Before any change the agent tells the user exactly what it will do, with the details, and asks the user to "
        "confirm (yes/no). Only after the user says yes does the agent make the change. One yes allows one change.",
        "No change without consent. The agent first writes out the action and its details, for example: Please "
        "confirm (yes/no): cancel_pending_order {oid}, no longer needed. If the user answers yes, the agent goes "
        "ahead; otherwise it changes nothing.",
        "Cancelling, changing an address, returning and exchanging all change the store's records, so each needs the "
        "user's yes. The agent asks the user to confirm (yes/no) right before the change and makes it only after "
        "the yes; a second change needs a second yes.")),
    ("cancel", (
        "Only a pending order can be cancelled, and only for one of two reasons: no longer needed, or ordered by "
        "mistake. The agent cancels it with cancel_pending_order, giving the order id and the reason. The status "
        "becomes cancelled and the amount paid is refunded: to a gift card at once, to a credit card or paypal in "
        "5 to 7 days.",
        "To cancel an order the agent needs the order id and the reason, which must be no longer needed or ordered "
        "by mistake; a user who ordered by mistake gets the second, a user who does not need it any more the first. "
        "cancel_pending_order works only while the order is pending.",
        "Cancellation: check that the order is pending, take the reason from the user (no longer needed, or ordered "
        "by mistake), confirm, then cancel_pending_order with the order id and the reason. The refund goes back to "
        "the payment method of the order.")),
    ("address", (
        "A pending order can be shipped to a new address. modify_pending_order_address takes the order id and the "
        "new address1, address2, city, state, country and zip; address2 may be empty and the country is USA.",
        "To change where a pending order goes, the agent confirms the new street, city, state and zip with the user "
        "and then calls modify_pending_order_address with the order id and the address fields (address1, address2, "
        "city, state, country, zip).",
        "Changing a shipping address is only possible while the order is pending. The agent copies the new address "
        "the user gives, field by field, into modify_pending_order_address together with the order id.")),
    ("return", (
        "The items of a delivered order can be returned. return_delivered_order_items needs the order id, the item "
        "ids to return, read from the order's items, and the payment method for the refund: the order's original "
        "payment method, the one in its payment history, or a gift card. The status becomes return requested.",
        "For a return the agent finds the item the user names in the order (its item id, not its product id) and "
        "the payment method id of the order's payment, then calls return_delivered_order_items with the order id, "
        "the item ids and that payment method id. Only a delivered order can be returned.",
        "Returns: the order must be delivered. The refund goes to the original payment method of the order (or to a "
        "gift card). The agent calls return_delivered_order_items with order_id, item_ids and payment_method_id.")),
    ("exchange", (
        "A delivered item can be exchanged for another option of the same product, such as another color or size. "
        "The agent reads the product with get_product_details, using the product id of the item in the order, and "
        "finds the variant with the option the user wants: its item id is the new item id.",
        "For an exchange the agent needs the order id, the item id of the item to exchange, the new item id (the "
        "variant of the same product with the wanted option, from get_product_details) and a payment method id for "
        "the price difference, normally the order's original one. It then calls exchange_delivered_order_items.",
        "Exchanges: the order must be delivered and the new item must be an available option of the same product. "
        "The status becomes exchange requested, and the price difference is charged or refunded to the payment "
        "method given.")),
    ("amount", (
        "When a user asks what they paid for an order, the agent reads the payment history of the order "
        "(get_order_details) and tells the amount of the payment, for example: You paid {paid} dollars.",
        "The amount paid for an order is the sum of its items' prices, and it is written in the order's payment "
        "history. The agent answers a question about it with the number read from the record, never a guess: You "
        "paid {paid} dollars.",
        "A question about money changes nothing, so it needs no confirmation: the agent verifies the user, reads the "
        "order and answers with the amount in its payment history.")),
)
TELECOM_POLICY = (
    ("verify", (
        "The phone company verifies a customer by phone number. find_customer_by_phone takes the number, such as "
        "{phone}, and returns the customer id; get_customer_details then shows the customer's name, balance and "
        "line ids.",
        "First the agent asks the customer for their phone number and looks up the customer id by phone "
        "(find_customer_by_phone). The customer's details (get_customer_details) list the customer's lines.",
        "No change is made for a caller who has not been verified. The phone number finds the customer "
        "(find_customer_by_phone); the customer id gives the details with get_customer_details.")),
    ("line", (
        "To find the caller's line the agent reads the customer's lines in the order they are listed, with "
        "get_line_details, until it reaches the line whose phone is the caller's number. A line record shows the "
        "line id (such as {lid}), its phone, its plan id, its status (active or suspended) and its data in GB.",
        "A customer may have several lines. The agent checks them one by one with get_line_details and acts on the "
        "line whose phone number is the one the customer gave.",
        "The line is checked before any change: get_line_details with the line id returns the phone, plan id, "
        "status and data of the line.")),
    ("confirm", (
        "Before any change the agent states it and asks the customer to confirm (yes/no); it acts only after a yes. "
        "One yes allows one change.",
        "No change without consent. The agent writes out the change, for example: Please confirm (yes/no): "
        "suspend_line {lid}, travel. Only if the customer answers yes does it go ahead.",
        "Suspending, resuming, changing a plan and adding data all need the customer's yes, asked for right before "
        "the change.")),
    ("suspend", (
        "Only an active line can be suspended, and only for one of two reasons: lost phone or travel. suspend_line "
        "takes the line id and the reason; the line's status becomes suspended.",
        "A customer who lost the phone, or who is going to travel, may suspend the line. The agent calls "
        "suspend_line with the line id and the reason, lost phone or travel.",
        "Suspension: check that the line is active, take the reason (lost phone, or travel), confirm, then "
        "suspend_line with the line id and the reason.")),
    ("resume", (
        "A suspended line is resumed with resume_line and the line id; its status becomes active again. An active "
        "line cannot be resumed.",
        "To resume a line the agent checks that it is suspended, confirms with the customer, and calls resume_line "
        "with the line id.",
        "Resuming needs only the line id: resume_line turns a suspended line back to active.")),
    ("plan", (
        "The company has three plans: {plans}. Plan ids differ from store to store, so the agent lists the plans "
        "(list_plans, which gives each plan's name and id) and uses the id of the plan the customer names.",
        "To change a plan the agent reads the plans' names and ids with list_plans and calls change_plan with the "
        "line id and the new plan id. The line must be active and the new plan different from its current one.",
        "Plans: {plans}. change_plan moves an active line to another plan; it takes the line id and the plan id, "
        "which the agent finds by the plan's name in list_plans.")),
    ("data", (
        "Extra data is added with add_data: the line id and the number of GB, from 1 to 10. Each GB costs 5 "
        "dollars, added to the customer's balance.",
        "A customer may buy more data for a line. add_data takes the line id and gb, the amount the customer asks "
        "for; the line's data grows by that many GB and the bill by 5 dollars per GB.",
        "Data top-ups: 1 to 10 GB at a time, 5 dollars per GB, with add_data on the caller's line.")),
    ("bill", (
        "What a customer owes is the balance in the customer's details (get_customer_details). The agent reads it "
        "and answers, for example: You owe {owe} dollars.",
        "A question about the bill changes nothing: the agent verifies the caller by phone, reads the customer's "
        "balance and tells it, such as: You owe {owe} dollars.",
        "The balance of a customer is the amount owed. The agent tells it as read from the record, never a guess.")),
)
POLICY = {"retail": RETAIL_POLICY, "telecom": TELECOM_POLICY}
POLICY_HEADS = {
    "retail": ("Store handbook for support agents.", "Online store: the agent policy.",
               "From the retail support manual.", "How a store agent handles a request."),
    "telecom": ("Phone company handbook for support agents.", "Telecom support: the agent policy.",
                "From the phone company's support manual.", "How a phone company agent handles a call."),
}
CASE_HEADS = {"retail": ("Case note, online store.", "A store ticket, worked end to end.", "Support log, retail."),
              "telecom": ("Case note, phone company.", "A phone company ticket, worked end to end.",
                          "Support log, telecom.")}
REQUEST_FORMS = ('The customer wrote: "{}"', 'A ticket came in: "{}"', 'The request read: "{}"')
IDENTITY_FORMS = {"retail": ("The agent asked for an email, or a name and zip, and the user gave {}.",
                             "Asked who they were, the user answered: {}."),
                  "telecom": ("The agent asked for the phone number, and the customer gave {}.",
                              "Asked for their phone number, the customer answered: {}.")}
LOOKUPS = {"get_order_details": "order_id", "get_product_details": "product_id", "get_user_details": "user_id",
           "get_customer_details": "customer_id", "get_line_details": "line_id"}   # a record's lookup -> its key
DONE_FORMS = ("The agent told the customer it was done, and the customer had nothing more to ask.",
              "The agent said it was done, and the ticket was closed.")


def _listed(words) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _args_prose(args) -> str:
    """A call's arguments in words: "order_id #W1234, item_ids 5678 and payment_method_id paypal_123" (empty ones left
    out, as the expert's confirmation leaves them out)."""
    shown = {k: ", ".join(v) if isinstance(v, list) else str(v) for k, v in args.items()}
    return _listed(f"{k} {v}" for k, v in shown.items() if v)


def _policy(rng, world) -> str:
    """A handbook section: 2-3 topics of the world's policy, in the order an episode meets them, each in one of its
    wordings, with an example's values drawn fresh (train users only)."""
    (first, last, k), = _people(rng, "train", 1)
    ex = {"uid": f"{first}_{last}_{k}".lower(), "oid": "#W" + _fresh(rng, set()), "phone": "555-" + _fresh(rng, set()),
          "lid": "L" + _fresh(rng, set()), "paid": rng.randint(20, 198), "owe": rng.randint(5, 99),
          "plans": _listed(f"{name} ({price} dollars a month, {gb} GB)" for name, price, gb in PLANS)}
    topics = POLICY[world]
    keep = sorted(rng.sample(range(len(topics)), rng.randint(2, 3)))
    parts = [rng.choice(POLICY_HEADS[world])] + [rng.choice(topics[i][1]).format(**ex) for i in keep]
    if rng.random() < 0.25:   # the agents' short brief, as the system prompt words it
        parts.append("In short: " + TINY_POLICY[world])
    return "\n".join(parts)


def _options(options) -> str:
    return " ".join(f"{k} {v}" for k, v in options.items())


def _prose(rng, record) -> str:
    """One record of the tiny stores (an order, a product, a user, a customer, a line) in prose."""
    r = record
    if "variants" in r:
        variants = [f"{_options(v['options'])} is item {v['item_id']} at {v['price']} dollars"
                    for v in r["variants"].values()]
        return rng.choice(("The {} (product {}) comes in these options: {}.", "Product {1} is a {0}: {2}.")).format(
            r["name"], r["product_id"], _listed(variants))
    if "items" in r:
        items = _listed(f"a {it['name']} (item {it['item_id']}, product {it['product_id']}, {_options(it['options'])}, "
                        f"{it['price']} dollars)" for it in r["items"])
        paid = _listed(f"a {p['transaction_type']} of {p['amount']} dollars with {p['payment_method_id']}"
                       for p in r["payment_history"])
        return f"Order {r['order_id']} of user {r['user_id']} is {r['status']}. It holds {items}. History: {paid}."
    if "email" in r:
        a, n = r["address"], r["name"]
        methods = _listed(m["id"] + (f" (balance {m['balance']} dollars)" if "balance" in m else "")
                          for m in r["payment_methods"].values())
        return (f"{n['first_name']} {n['last_name']} has user id {r['user_id']} and email {r['email']}, and lives at "
                f"{a['address1']}, {a['city']}, {a['state']} {a['zip']}. Payment methods: {methods}. "
                f"Orders: {_listed(r['orders'])}.")
    if "line_ids" in r:
        return (f"Customer {r['name']} ({r['customer_id']}) owes {r['balance']} dollars and has "
                f"{'line' if len(r['line_ids']) == 1 else 'lines'} {_listed(r['line_ids'])}.")
    return (f"Line {r['line_id']} of {r['customer_id']} has phone {r['phone']}, plan {r['plan_id']}, status "
            f"{r['status']} and {r['data_gb']} GB of data.")


def _shown(rng, tool, key, text) -> str:
    """A lookup's record (`text`, what `tool` returned for `key`) as the text shows it: the tool's exact result (JSON,
    as the agent reads it in an episode) or, one time in two, the same record in prose."""
    if rng.random() < 0.5:
        return _prose(rng, json.loads(text))
    noun = LOOKUPS[tool].split("_")[0]
    return f"{tool} for {noun} {key} " + rng.choice(("returns:", "gives:", "shows:")) + "\n" + text


def _looked_up(rng, world, db, tool, key) -> str:
    return _shown(rng, tool, key, run_tool(world, db, tool, {LOOKUPS[tool]: key})[0])


def _records(rng, task) -> str:
    """A record sheet of one fresh store: retail, its product types, a product and a user with one of their
    orders; telecom, its plans and a customer with their lines."""
    world, db = task.gold["world"], task.gold["db"]
    if world == "retail":
        uid = rng.choice(sorted(db["users"]))
        parts = [rng.choice(("Store records.", "From the store's database.")), "Product types (list_all_product_types): "
                 + run_tool(world, db, "list_all_product_types", {})[0]]
        parts += [_looked_up(rng, world, db, "get_product_details", rng.choice(sorted(db["products"]))),
                  _looked_up(rng, world, db, "get_user_details", uid),
                  _looked_up(rng, world, db, "get_order_details", rng.choice(db["users"][uid]["orders"]))]
    else:
        cid = rng.choice(sorted(db["customers"]))
        plans = _listed(f"{p['name']} is plan {p['plan_id']} at {p['price']} dollars a month with {p['data_gb']} GB"
                        for p in db["plans"].values())
        parts = [rng.choice(("Phone company records.", "From the phone company's database.")), f"Plans: {plans}.",
                 "list_plans returns: " + run_tool(world, db, "list_plans", {})[0],
                 _looked_up(rng, world, db, "get_customer_details", cid)]
        parts += [_looked_up(rng, world, db, "get_line_details", lid) for lid in db["customers"][cid]["line_ids"]]
    return "\n".join(parts)


def _case(rng, task) -> str:
    """A ticket worked end to end, as a narrative: the request, the identity, each gold lookup and what it returned,
    the confirmation and the user's yes, the change and its outcome, the answer."""
    g, world = task.gold, task.gold["world"]
    db = json_copy(g["db"])
    parts = [rng.choice(CASE_HEADS[world]), rng.choice(REQUEST_FORMS).format(g["user"]["goal"]),
             rng.choice(IDENTITY_FORMS[world]).format(g["user"]["identity"])]
    for a in g["actions"]:
        name, args = a["name"], a["arguments"]
        if name in WRITES:
            parts.append(rng.choice(('The agent asked: "{ask}" The customer said yes.',
                                     "The agent asked the customer to confirm (yes/no) {name} with {args}, and the "
                                     "customer answered yes.")).format(ask=confirmation(name, args), name=name,
                                                                        args=_args_prose(args)))
        text, _ = run_tool(world, db, name, args)
        parts.append(_case_step(rng, world, db, g, name, args, text))
    if g["outputs"]:   # an information request: the answer read off the record
        parts.append(rng.choice(('The agent answered: "{}"', 'The agent told the customer: "{}"')).format(
            ANSWER[g["kind"]].format(g["outputs"][0])))
    else:
        parts.append(rng.choice(DONE_FORMS))
    return "\n".join(parts)


def _case_step(rng, world, db, g, name, args, text) -> str:
    """One gold action of a case note, in words, with what it returned."""
    if name.startswith("find_"):
        by = {"find_user_id_by_email": "the user id by email", "find_user_id_by_name_zip": "the user id by name and zip",
              "find_customer_by_phone": "the customer id by phone number"}[name]
        return f"The agent looked up {by} ({name} with {_args_prose(args)}) and got {text}."
    if name == "list_plans":
        want = g["actions"][-1]["arguments"]["plan_id"]
        return f"list_plans returned {text}: the {db['plans'][want]['name']} plan is plan {want}."
    if name.startswith("get_"):
        record = json.loads(text)
        out = _shown(rng, name, next(iter(args.values())), text)
        if name == "get_line_details":   # the caller's line is the one with the phone the caller gave
            mine = record["phone"] == g["user"]["identity"]
            out += "\nThat is the caller's phone." if mine else "\nThat is not the caller's phone, so the agent read on."
        if name == "get_product_details":
            new = g["actions"][-1]["arguments"]["new_item_ids"][0]
            out += f"\nThe wanted option, {_options(record['variants'][new]['options'])}, is item {new}."
        return out
    result = json.loads(text)
    status = f"the line is now {result['status']}" if world == "telecom" else f"the order's status is now {result['status']}"
    if name == "change_plan":
        status = f"the line is now on plan {result['plan_id']}"
    if name == "add_data":
        status = (f"the line now has {result['data_gb']} GB, and the customer's balance is "
                  f"{db['customers'][result['customer_id']]['balance']} dollars")
    return rng.choice(("The agent then called {} with {}: {}.", "With the yes, the agent ran {} ({}), and {}.")).format(
        name, _args_prose(args), status)


def _knowledge(n, seed):
    """EcommerceEnv.knowledge's documents with what they show: [{"kind", "world", "doc", "task"}], `task` the fresh
    tiny task whose store a record sheet or a case note shows (None for policy)."""
    rng, out = random.Random(f"ecommerce-knowledge:{seed}"), []
    for _ in range(n):
        kind, world = rng.choice(KNOWLEDGE_KINDS), rng.choice(("retail", "telecom"))
        # Train residues for telecom too: a telecom customer's id then never spells a val or test retail user's id.
        task = None if kind == "policy" else (_retail_task if world == "retail" else _telecom_task)(
            rng, "train", "knowledge")
        doc = _policy(rng, world) if kind == "policy" else _records(rng, task) if kind == "records" else _case(rng, task)
        out.append({"kind": kind, "world": world, "doc": doc, "task": task})
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

    def knowledge(self, n, seed=0):
        """The two tiny stores (retail; telecom, the ood split's) in plain text, never a chat turn or a tool call (the
        stage teaches them), each document a fresh store's, retail and telecom about equally:
        - policy (1 document in 3): a handbook section, 2-3 topics (verifying, checking, confirming, each operation and
          the facts it needs, an amount or a bill), each in one of a few wordings;
        - records (1 in 3): a store's record sheet, retail's products and a user with an order, telecom's plans
          and a customer with their lines, each record in prose or as the JSON its tool returns;
        - case notes (1 in 3): a tiny task of either world and any kind worked end to end as a narrative: the
          request, the identity given, each lookup and its record, the confirmation and the yes, the change, the answer.
        Retail users are train-split users (RESIDUES): no val or test user ever appears."""
        return [d["doc"] for d in _knowledge(n, seed)]
