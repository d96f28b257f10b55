"""tau3's telecom domain at full scale: dual control. The agent works on the carrier's records (customers,
lines, plans, bills, devices); the user holds a simulated phone and works it with tools of its own (airplane
mode, SIM, mobile data, roaming, APN, Wi-Fi calling, VPN, app permissions, speed test, paying a bill). A task
breaks the phone and/or the account in its initial state; the reward is tau2's ENV_ASSERTION (and ACTION) on
the final phone and records: is mobile data working, is the speed excellent, can the phone send an MMS...

    env = EcommerceEnv(data="data/tau2/domains/telecom", user_url=..., user_model=...)   # split: base, small, ...
    python bench/tau_gold_replay.py data/tau2/domains/telecom small   # tau3's 20 small tasks -> 20 solved by gold, 0 by nothing

A data directory holds tau2's db.toml, user_db.toml, tasks.json, split_tasks.json, main_policy.md and
tech_support_manual.md (envs/ecommerce.py's load_store reads it, and its EcommerceEnv runs the episode).
Everything here is a plain function of the databases (JSON-like dicts), as in ecommerce.py:
- TOOLS / USER_TOOLS: (function, description, properties[, required]) rows, the tables ecommerce.py turns
  into schemas; a refusal raises ToolError.
- INIT_ONLY: the set-up functions tau2's initialization_actions call (breaking the phone, suspending a line
  for an overdue bill); never offered to anyone.
- ASSERTIONS: the checks env_assertions name, on the agent's (records) or the user's (phone) database.
- sync(db, user_db): what tau2's TelecomEnvironment.sync_tools does after every call: the line's status,
  roaming and data allowance reach the phone's surroundings, a paid request marks its bill paid, and a bill
  awaiting payment appears on the phone as a payment request.
The phone's rules (the network search, when mobile data works, the speed test, when an MMS can be sent) follow
tau2-bench's telecom user tools, set-up functions included (a turn_*_on/off that finds the setting already there
still searches the network, as tau2's toggles do). Differences: records are keyed by id (tau2 keeps lists); a draft
bill made by refuel_data gets an id from the customer and its bill count (tau2 draws a random uuid), so two replays
agree; tau2's break_vpn quirk (a reconnect stays poor) is kept per task, behind SHARED_VPN_DEFAULT.
"""
import datetime
import hashlib
import json

from envs.base import ToolError, deep_update, json_copy

TODAY = "2025-02-25"          # tau2's telecom clock is fixed
ID_FIELDS = {"plans": "plan_id", "customers": "customer_id", "lines": "line_id", "bills": "bill_id",
             "devices": "device_id"}


def load_db(tables: dict) -> dict:
    """tau2's db.toml (lists of records) -> {table: {id: record}}; dates become ISO strings."""
    tables = json.loads(json.dumps(tables, default=lambda d: d.isoformat()))
    db = {}
    for table, key in ID_FIELDS.items():
        rows = tables.get(table)
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get(key), str) for r in rows):
            raise ValueError(f"db.toml needs a list [[{table}]] of records with a {key}")
        db[table] = {r[key]: r for r in rows}
    return db


# ---------------------------------------------------------------------------------------------------
# The agent's tools: the carrier's records.

def _find(db, table, key, what):
    if key not in db[table]:
        raise ToolError(f"{what} {key} not found")
    return db[table][key]


def _line_by_phone(db, phone_number):
    for line in db["lines"].values():
        if line.get("phone_number") == phone_number:
            return line
    raise ToolError(f"Line with phone number {phone_number} not found")


def _target_line(db, customer_id, line_id):
    if line_id not in _find(db, "customers", customer_id, "Customer")["line_ids"]:
        raise ToolError(f"Line {line_id} not found for customer {customer_id}")
    return _find(db, "lines", line_id, "Line")


def get_customer_by_phone(db, phone_number):
    for c in db["customers"].values():
        if c.get("phone_number") == phone_number or any(
                db["lines"].get(lid, {}).get("phone_number") == phone_number for lid in c["line_ids"]):
            return c
    raise ToolError(f"Customer with phone number {phone_number} not found")


def get_customer_by_id(db, customer_id):
    return _find(db, "customers", customer_id, "Customer")


def get_customer_by_name(db, full_name, dob):
    return [c for c in db["customers"].values()
            if c.get("full_name", "").lower() == full_name.lower() and c.get("date_of_birth") == dob]


def get_details_by_id(db, id):
    tables = {"L": ("lines", "Line"), "D": ("devices", "Device"), "B": ("bills", "Bill"), "C": ("customers", "Customer"),
              "P": ("plans", "Plan")}
    if id[:1] not in tables:
        raise ToolError(f"Unknown ID format or type: {id}")
    table, what = tables[id[:1]]
    return _find(db, table, id, what)


def suspend_line(db, customer_id, line_id, reason):
    line = _target_line(db, customer_id, line_id)
    if line["status"] != "Active":
        raise ToolError("Line must be active to suspend")
    line.update(status="Suspended", suspension_start_date=TODAY)
    return {"message": "Line suspended successfully. $5/month holding fee will apply.", "line": line}


def resume_line(db, customer_id, line_id):
    line = _target_line(db, customer_id, line_id)
    if line["status"] not in ("Suspended", "Pending Activation"):
        raise ToolError("Line must be suspended to resume")
    line.update(status="Active", suspension_start_date=None)
    return {"message": "Line resumed successfully", "line": line}


def get_bills_for_customer(db, customer_id, limit=12):
    bills = [_find(db, "bills", b, "Bill") for b in get_customer_by_id(db, customer_id)["bill_ids"]]
    return sorted(bills, key=lambda b: b["issue_date"], reverse=True)[:limit]


def _awaiting(db, customer):
    return [db["bills"][b] for b in customer["bill_ids"] if db["bills"].get(b, {}).get("status") == "Awaiting Payment"]


def send_payment_request(db, customer_id, bill_id):
    customer = get_customer_by_id(db, customer_id)
    if _awaiting(db, customer):
        raise ToolError("A bill is already awaiting payment for this customer")
    if bill_id not in customer["bill_ids"]:
        raise ToolError(f"Bill {bill_id} not found for customer {customer_id}")
    _find(db, "bills", bill_id, "Bill")["status"] = "Awaiting Payment"
    return f"Payment request sent to the customer for bill {bill_id}"


def _month_start(iso, months_ahead):
    y, m = int(iso[:4]), int(iso[5:7]) + months_ahead
    y, m = y + (m - 1) // 12, (m - 1) % 12 + 1
    return f"{y:04d}-{m:02d}-01"


def _day_before(iso):
    return (datetime.date.fromisoformat(iso) - datetime.timedelta(days=1)).isoformat()


def _plus_days(iso, n):
    return (datetime.date.fromisoformat(iso) + datetime.timedelta(days=n)).isoformat()


def _charge(db, customer_id, amount, description):
    """A line item on the customer's draft bill (a new draft for next month when there is none)."""
    customer = get_customer_by_id(db, customer_id)
    draft = next((db["bills"][b] for b in customer["bill_ids"] if db["bills"].get(b, {}).get("status") == "Draft"), None)
    if draft is None:
        start = _month_start(TODAY, 1)
        bill_id = "B" + hashlib.sha256(f"{customer_id}/{len(customer['bill_ids'])}".encode()).hexdigest()[:8]
        draft = {"bill_id": bill_id, "customer_id": customer_id, "period_start": start,
                 "period_end": _day_before(_month_start(start, 1)), "issue_date": start, "total_due": 0,
                 "due_date": _plus_days(start, 14), "status": "Draft", "line_items": []}
        db["bills"][bill_id] = draft
        customer["bill_ids"].append(bill_id)
    draft["line_items"].append({"description": description, "amount": amount, "date": TODAY,
                                "item_type": "Credit" if amount < 0 else "Charge"})
    draft["total_due"] += amount


def get_data_usage(db, customer_id, line_id):
    line = _target_line(db, customer_id, line_id)
    plan = _find(db, "plans", line["plan_id"], "Plan")
    return {"line_id": line_id, "data_used_gb": line["data_used_gb"], "data_limit_gb": plan["data_limit_gb"],
            "data_refueling_gb": line["data_refueling_gb"], "cycle_end_date": _day_before(_month_start(TODAY, 1))}


def enable_roaming(db, customer_id, line_id):
    line = _target_line(db, customer_id, line_id)
    if line["roaming_enabled"]:
        return "Roaming was already enabled"
    line["roaming_enabled"] = True
    return "Roaming enabled successfully"


def disable_roaming(db, customer_id, line_id):
    line = _target_line(db, customer_id, line_id)
    if not line["roaming_enabled"]:
        return "Roaming was already disabled"
    line["roaming_enabled"] = False
    return "Roaming disabled successfully"


def transfer_to_human_agents(db, summary):
    return "Transfer successful"


def refuel_data(db, customer_id, line_id, gb_amount):
    line = _target_line(db, customer_id, line_id)
    if gb_amount <= 0:
        raise ToolError("Refuel amount must be positive")
    price = _find(db, "plans", line["plan_id"], "Plan")["data_refueling_price_per_gb"]
    line["data_refueling_gb"] += gb_amount
    _charge(db, customer_id, gb_amount * price, f"Data refueling: {gb_amount} GB at ${price}/GB")
    return {"message": f"Successfully added {gb_amount} GB of data for line {line_id} for ${gb_amount * price:.2f}",
            "new_data_refueling_gb": line["data_refueling_gb"], "charge": gb_amount * price}


# set-up only (initialization_actions on the agent's side)
def set_data_usage(db, customer_id, line_id, data_used_gb):
    _target_line(db, customer_id, line_id)["data_used_gb"] = data_used_gb
    return f"Data usage set to {data_used_gb} GB for line {line_id}"


def suspend_line_for_overdue_bill(db, customer_id, line_id, new_bill_id, contract_ended):
    line = _find(db, "lines", line_id, "Line")
    if line["status"] != "Active":
        raise ToolError("Line must be active to suspend for unpaid bill")
    amount = _find(db, "plans", line["plan_id"], "Plan")["price_per_month"]
    customer = get_customer_by_id(db, customer_id)
    if any(db["bills"].get(b, {}).get("status") == "Overdue" for b in customer["bill_ids"]):
        raise ToolError("Customer already has an overdue bill")
    start, end = _month_start(TODAY, -1), _day_before(_month_start(TODAY, 0))
    db["bills"][new_bill_id] = {"bill_id": new_bill_id, "customer_id": customer_id, "period_start": start,
                                "period_end": end, "issue_date": start, "total_due": amount,
                                "due_date": _plus_days(start, 14), "status": "Overdue",
                                "line_items": [{"description": f"Charge for line {line_id}", "amount": amount,
                                                "date": TODAY, "item_type": "Charge"}]}
    customer["bill_ids"].append(new_bill_id)
    line.update(status="Suspended", suspension_start_date=TODAY)
    if contract_ended:
        line["contract_end_date"] = end
    return f"Line {line_id} suspended for unpaid bill {new_bill_id}. Contract ended: {contract_ended}"


# ---------------------------------------------------------------------------------------------------
# The user's phone: user_db = {"device": {...}, "surroundings": {...}}.

DEVICE = {   # tau2's MockPhoneAttributes defaults (user_db.toml overrides them)
    "sim_card_status": "active", "sim_card_missing": False, "airplane_mode": False,
    "network_signal_strength": "good", "network_technology_connected": "5G", "network_connection_status": "connected",
    "battery_level": 80, "data_enabled": True, "roaming_enabled": False, "network_mode_preference": "4g_5g_preferred",
    "active_apn_settings": {"apn_name": "internet", "reset_at_reboot": False, "mms_apn": "mms",
                            "mmsc_url": "http://mms.carrier.com/mms/wapenc", "mms_proxy": None, "mms_port": None},
    "wifi_enabled": False, "wifi_connected": False, "wifi_ssid": None, "wifi_signal_strength": "none",
    "wifi_calling_enabled": False, "wifi_calling_mms_over_wifi": False, "data_saver_mode": False,
    "vpn_enabled_setting": False, "vpn_connected": False, "vpn_details": None,
    "app_statuses": {"messaging": {"app_name": "messaging", "permissions": {"sms": True, "storage": True, "phone": True,
                                                                            "network": False}},
                     "browser": {"app_name": "browser", "permissions": {"sms": False, "storage": True, "phone": False,
                                                                        "network": True}}},
}
SURROUNDINGS = {"name": None, "phone_number": None, "is_abroad": False, "roaming_allowed": False,
                "signal_strength": {"2G": "poor", "3G": "fair", "4G": "good", "5G": "excellent"},
                "mobile_data_usage_exceeded": False, "line_active": True, "payment_request": None}
MODES = {"4g_5g_preferred": "5G", "4g_only": "4G", "3g_only": "3G", "2g_only": "2G"}
APN_DEFAULT = DEVICE["active_apn_settings"]
VPN_DEFAULT = {"server_address": "192.168.1.1", "protocol": "OpenVPN", "server_performance": "excellent"}
# tau2's connect_vpn hands the phone its shared default VPN details (not a copy), and break_vpn, having connected
# through it, marks that shared object poor: every later (re)connect then gets a poor server too. True keeps that
# quirk, for the phone of the task that ran break_vpn (the user db keeps the spoiled default as "vpn_default"), so
# reconnecting does not fix a broken VPN, as in tau2's scores; False: a reconnect gets an excellent server again.
# tau2 spoils the default for the whole process, later tasks included; a task here never leaks into the next.
SHARED_VPN_DEFAULT = True
SIGNAL_ICON = {"none": "No Signal", "poor": "Signal 1/4 Poor", "fair": "Signal 2/4 Fair", "good": "Signal 3/4 Good",
               "excellent": "Signal 4/4 Excellent"}


def load_user_db(data: dict) -> dict:
    """tau2's user_db.toml -> the phone and its surroundings, tau2's defaults filled in."""
    return {"device": deep_update(json_copy(DEVICE), data.get("device") or {}),
            "surroundings": deep_update(json_copy(SURROUNDINGS), data.get("surroundings") or {})}


def _no_network(d):
    d.update(network_connection_status="no_service", network_technology_connected="none", network_signal_strength="none")


def _sim(d):
    return "missing" if d["sim_card_missing"] else d["sim_card_status"]


def simulate_network_search(u):
    """The phone looks for a network: with an active SIM it connects to the best technology its mode preference
    allows (4g_5g_preferred falls back to 4G where there is no 5G signal), at the signal the surroundings have;
    no service without a SIM, with a locked one, in airplane mode, with a broken APN or an inactive line."""
    d, s = u["device"], u["surroundings"]
    if _sim(d) == "active":
        tech = MODES.get(d["network_mode_preference"], "4G")
        if tech == "5G" and s["signal_strength"].get("5G", "none") == "none":
            tech = "4G"
        d.update(network_connection_status="connected", network_technology_connected=tech,
                 network_signal_strength=s["signal_strength"].get(tech, "none"))
    else:
        _no_network(d)
    if d["airplane_mode"] or d["active_apn_settings"]["apn_name"] == "broken" or not s["line_active"]:
        _no_network(d)


def _data_works(u):
    d, s = u["device"], u["surroundings"]
    if d["airplane_mode"] or d["network_signal_strength"] == "none" or d["network_connection_status"] == "no_service":
        return False
    if s["is_abroad"] and not (d["roaming_enabled"] and s["roaming_allowed"]):
        return False
    return d["data_enabled"] and not s["mobile_data_usage_exceeded"]


def _speed(u):
    """(Mbps, description) of a speed test, or (None, 'No Connection'): the middle of the technology's range,
    scaled by the signal, by 0.1 behind a poor VPN server and by 0.2 in data saver mode."""
    d = u["device"]
    if not _data_works(u):
        return None, "No Connection"
    factor = 0.1 if d["vpn_connected"] and (d["vpn_details"] or {}).get("server_performance") == "poor" else 1.0
    factor *= 0.2 if d["data_saver_mode"] else 1.0
    lo, hi = {"2G": (0.1, 0.4), "3G": (1.0, 5.0), "4G": (10.0, 100.0), "5G": (50.0, 500.0)}.get(
        d["network_technology_connected"], (0.0, 0.0))
    signal = {"poor": 0.2, "fair": 0.5, "good": 0.8, "excellent": 1.0}.get(d["network_signal_strength"], 0.0)
    mbps = round((lo + hi) / 2 * signal * factor, 2)
    desc = next(name for bound, name in ((1, "Very Poor"), (5, "Poor"), (25, "Fair"), (100, "Good"),
                                         (float("inf"), "Excellent")) if mbps < bound)
    return mbps, desc


def _mms_works(u):
    d = u["device"]
    app = d["app_statuses"].get("messaging")
    return (_data_works(u) and d["network_technology_connected"] != "2G"
            and not (d["wifi_calling_enabled"] and d["wifi_calling_mms_over_wifi"])
            and d["active_apn_settings"].get("mmsc_url") is not None
            and app is not None and app["permissions"]["storage"] and app["permissions"]["sms"])


def check_status_bar(u):
    d = u["device"]
    if d["airplane_mode"]:
        bar = ["Airplane Mode"]
    else:
        bar = [SIGNAL_ICON.get(d["network_signal_strength"], "No Signal")]
        tech = d["network_technology_connected"]
        bar += [tech] if tech != "none" else []
        bar += (["Data Enabled"] + ["Data Saver"] * d["data_saver_mode"]) if d["data_enabled"] and tech != "none" \
            else ["Data Disabled"]
    if d["wifi_enabled"] and d["wifi_connected"]:
        bar.append(f"Wi-Fi connected to {d['wifi_ssid']}" if d["wifi_ssid"] else "Wi-Fi enabled")
    bar += ["VPN Connected"] * d["vpn_connected"]
    return "Status Bar: " + " | ".join(bar + [f"Battery {d['battery_level']}%"])


def _done(u, text):
    return f"{text}\n{check_status_bar(u)}"


def check_network_status(u):
    d, on = u["device"], lambda x: "ON" if x else "OFF"
    yes = lambda x: "Yes" if x else "No"   # noqa: E731
    lines = [f"Airplane Mode: {on(d['airplane_mode'])}", f"SIM Card Status: {_sim(d)}",
             f"Cellular Connection: {d['network_connection_status']}", f"Cellular Signal: {d['network_signal_strength']}",
             f"Cellular Network Type: {d['network_technology_connected']}", f"Mobile Data Enabled: {yes(d['data_enabled'])}",
             f"Data Roaming Enabled: {yes(d['roaming_enabled'])}", f"Wi-Fi Radio: {on(d['wifi_enabled'])}",
             f"Wi-Fi Connected: {yes(d['wifi_connected'])}"]
    return "\n".join(lines + ([f"Connected Wi-Fi Network: {d['wifi_ssid']}"] if d["wifi_connected"] else []))


def check_network_mode_preference(u):
    return f"Network Mode Preference: {u['device']['network_mode_preference']}"


def set_network_mode_preference(u, mode):
    if mode not in MODES:
        return f"Failed to set network mode: '{mode}' is not a valid option. Please use one of: {', '.join(MODES)}."
    u["device"]["network_mode_preference"] = mode
    simulate_network_search(u)
    return _done(u, f"Preferred Network Mode set to: {mode}")


def run_speed_test(u):
    mbps, desc = _speed(u)
    if mbps is None:
        return f"Speed test failed: {desc}."
    advice = {"Very Poor": "Connection is very slow. Basic web browsing might be difficult.",
              "Poor": "Connection is slow. Web browsing may be sluggish, streaming difficult.",
              "Fair": "Connection is okay for web browsing and some standard definition streaming.",
              "Good": "Connection is good for most activities, including HD streaming.",
              "Excellent": "Connection is very fast."}[desc]
    return f"Speed Test Result: {mbps:.2f} Mbps ({desc}). {advice}"


def _wifi_off(d):
    d.update(wifi_connected=False, wifi_ssid=None, wifi_signal_strength="none")


def _toggle_airplane(u):
    d = u["device"]
    d["airplane_mode"] = not d["airplane_mode"]
    if not d["airplane_mode"]:
        d["network_connection_status"] = "searching"
    if d["wifi_enabled"] or d["airplane_mode"]:
        _wifi_off(d)
    if d["airplane_mode"]:
        d.update(vpn_connected=False, vpn_details=None)
    simulate_network_search(u)
    return d["airplane_mode"]


def toggle_airplane_mode(u):
    return _done(u, f"Airplane Mode is now {'ON' if _toggle_airplane(u) else 'OFF'}.")


def check_sim_status(u):
    return {"active": "Your SIM card is active and working.", "missing": "No SIM card detected in the phone.",
            "locked_pin": "The SIM card is locked with a PIN code.",
            "locked_puk": "The SIM card is locked with a PUK code."}.get(_sim(u["device"]), "Unknown SIM status.")


def reseat_sim_card(u):
    u["device"]["sim_card_missing"] = False
    simulate_network_search(u)
    return _done(u, "SIM card re-seated successfully.")


def _toggle(u, key, search=True):
    u["device"][key] = not u["device"][key]
    if search:
        simulate_network_search(u)
    return u["device"][key]


def toggle_data(u):
    return _done(u, f"Mobile Data is now {'ON' if _toggle(u, 'data_enabled') else 'OFF'}.")


def toggle_roaming(u):
    return _done(u, f"Data Roaming is now {'ON' if _toggle(u, 'roaming_enabled') else 'OFF'}.")


def check_data_restriction_status(u):
    return "Data Saver mode is ON (limits data usage)." if u["device"]["data_saver_mode"] else "Data Saver mode is OFF."


def toggle_data_saver_mode(u):
    return _done(u, f"Data Saver Mode is now {'ON' if _toggle(u, 'data_saver_mode', search=False) else 'OFF'}.")


def check_apn_settings(u):
    apn = u["device"]["active_apn_settings"]
    return (f"Current APN Name: {apn['apn_name'] or 'Not Set'}\nMMSC URL (for picture messages): "
            f"{apn.get('mmsc_url') or 'Not Set'}\n(These are technical settings, usually best left as they are.)")


def set_apn_settings(u, apn_settings):
    unknown = set(apn_settings) - set(APN_DEFAULT)
    if unknown or apn_settings.get("apn_name", "internet") not in ("internet", "broken"):
        raise ToolError(f"invalid APN settings: fields are {', '.join(APN_DEFAULT)}; apn_name 'internet' or 'broken'")
    u["device"]["active_apn_settings"] = dict(json_copy(APN_DEFAULT), **apn_settings)
    simulate_network_search(u)
    return _done(u, f"APN settings set to: {u['device']['active_apn_settings']['apn_name']}")


def reset_apn_settings(u):
    u["device"]["active_apn_settings"]["reset_at_reboot"] = True
    simulate_network_search(u)
    return _done(u, "APN settings will reset at reboot.")


def check_wifi_status(u):
    d = u["device"]
    if not d["wifi_enabled"]:
        return "Wi-Fi is turned OFF."
    return (f"Wi-Fi is ON and connected to '{d['wifi_ssid']}'. Signal strength: {d['wifi_signal_strength']}."
            if d["wifi_connected"] else "Wi-Fi is ON but not connected to any network.")


def toggle_wifi(u):
    d = u["device"]
    if d["airplane_mode"]:
        return _done(u, "Cannot change Wi-Fi settings while Airplane Mode is ON.")
    d["wifi_enabled"] = not d["wifi_enabled"]
    if not d["wifi_enabled"]:
        _wifi_off(d)
    return _done(u, f"Wi-Fi is now {'ON' if d['wifi_enabled'] else 'OFF'}.")


def check_wifi_calling_status(u):
    return f"Wi-Fi Calling is currently turned {'ON' if u['device']['wifi_calling_enabled'] else 'OFF'}."


def toggle_wifi_calling(u):
    return _done(u, f"Wi-Fi Calling is now {'ON' if _toggle(u, 'wifi_calling_enabled', search=False) else 'OFF'}.")


def check_vpn_status(u):
    d = u["device"]
    if d["vpn_connected"]:
        return f"VPN is ON and connected. Details: {d['vpn_details']}" if d["vpn_details"] else \
            "VPN is ON and connected (no specific details available)."
    return "VPN is turned ON in settings, but currently not connected." if d["vpn_enabled_setting"] else "VPN is turned OFF."


def connect_vpn(u):
    d = u["device"]
    if d["vpn_connected"]:
        return "VPN already connected."
    d.update(vpn_connected=True, vpn_details=dict(u.get("vpn_default") or VPN_DEFAULT))
    return _done(u, "VPN connected successfully.")


def disconnect_vpn(u):
    d = u["device"]
    was = d["vpn_connected"]
    d.update(vpn_connected=False, vpn_details=None)
    return _done(u, "VPN disconnected successfully." if was else "No active VPN connection to disconnect.")


def check_installed_apps(u):
    return f"The following apps are installed on the phone: {', '.join(u['device']['app_statuses'])}"


def _granted(u, app_name):
    app = u["device"]["app_statuses"].get(app_name)
    return None if app is None else [p for p, on in app["permissions"].items() if on]


def check_app_status(u, app_name):
    perms = _granted(u, app_name)
    if perms is None:
        return f"App '{app_name}' not found on this phone."
    return "\n".join([f"Status for App: {app_name}"] + ([" - Permissions Granted:"] + [f"   - {p}" for p in perms]
                                                      if perms else [" - Permissions: None granted."]))


def check_app_permissions(u, app_name):
    perms = _granted(u, app_name)
    if perms is None:
        return f"App '{app_name}' not found on this phone."
    return f"App '{app_name}' has permission for: {', '.join(perms)}." if perms else \
        f"App '{app_name}' currently has no permissions granted."


def _set_permission(u, app_name, permission, value):
    app = u["device"]["app_statuses"].get(app_name)
    if app is None:
        raise ToolError(f"App '{app_name}' not found.")
    if permission.lower() not in app["permissions"]:
        raise ToolError(f"Permission '{permission}' not tracked for app '{app_name}', available permissions: "
                        f"{list(app['permissions'])}")
    app["permissions"][permission.lower()] = value


def grant_app_permission(u, app_name, permission):
    _set_permission(u, app_name, permission, True)
    return _done(u, f"Success. Permission '{permission.lower()}' granted to app '{app_name}'.")


def can_send_mms(u):
    return "Your messaging app can send MMS messages." if _mms_works(u) else "Your messaging app cannot send MMS messages."


def reboot_device(u):
    d, lines = u["device"], []
    if d["active_apn_settings"].get("reset_at_reboot"):
        lines.append("Resetting APN settings...")
        d["active_apn_settings"] = json_copy(APN_DEFAULT)
    lines.append("Restarting network services...")
    d["network_connection_status"] = "searching"
    simulate_network_search(u)
    return _done(u, "\n".join(lines))


def check_payment_request(u):
    r = u["surroundings"]["payment_request"]
    return "No payment request has been made." if r is None else \
        f"You have a payment request for bill {r['bill_id']} of {r['amount_due']} USD."


def make_payment(u):
    r = u["surroundings"]["payment_request"]
    if r is None:
        return "You do not have a payment request."
    r["paid"] = True
    return f"Payment of {r['amount_due']} USD has been made for bill {r['bill_id']}."


# set-up only (initialization_actions on the user's side): they break the phone, or place the user
def set_user_info(u, name, phone_number):
    u["surroundings"].update(name=name, phone_number=phone_number)


def set_user_location(u, abroad):
    u["surroundings"]["is_abroad"] = abroad


def _switch(key, value, search=True):
    """tau2's turn_<setting>_on/off: toggled until it has `value`, each toggle a network search where tau2's toggle
    searches. So the phone searches even when the setting already had its value (a no-op switch still refreshes the
    signal: after set-up the phone shows what its surroundings give, not what user_db.toml said)."""
    def f(u):
        u["device"][key] = value
        if search:
            simulate_network_search(u)
    return f


def turn_airplane_mode(value):
    """tau2 toggles at least once, and again if that left the other state: turning it off when it is off passes
    through airplane mode (Wi-Fi and the VPN dropped), as tau2's does."""
    def f(u):
        if _toggle_airplane(u) != value:
            _toggle_airplane(u)
    return f


def unseat_sim_card(u):
    u["device"]["sim_card_missing"] = True
    simulate_network_search(u)


def lock_sim_card(u, mode):
    if mode not in ("pin", "puk"):
        raise ToolError(f"lock mode must be pin or puk, not {mode!r}")
    u["device"]["sim_card_status"] = "locked_" + mode
    simulate_network_search(u)


def break_apn_settings(u):
    u["device"]["active_apn_settings"]["apn_name"] = "broken"
    simulate_network_search(u)


def break_apn_mms_setting(u):
    u["device"]["active_apn_settings"]["mmsc_url"] = None


def set_wifi_calling(u, enabled, mms_over_wifi=None):
    u["device"]["wifi_calling_enabled"] = enabled
    if mms_over_wifi is not None:
        u["device"]["wifi_calling_mms_over_wifi"] = mms_over_wifi


def break_vpn(u):
    d = u["device"]
    connects = not d["vpn_connected"]   # an already connected VPN keeps its own details: tau2's default is untouched
    if connects:
        d.update(vpn_connected=True, vpn_details=dict(u.get("vpn_default") or VPN_DEFAULT))
    d["vpn_details"]["server_performance"] = "poor"
    if connects and SHARED_VPN_DEFAULT:
        u["vpn_default"] = dict(d["vpn_details"])


def remove_app_permission(u, app_name, permission):
    _set_permission(u, app_name, permission, False)


INIT_ONLY = {
    "set_data_usage": set_data_usage, "suspend_line_for_overdue_bill": suspend_line_for_overdue_bill,
    "set_user_info": set_user_info, "set_user_location": set_user_location, "simulate_network_search": simulate_network_search,
    "turn_airplane_mode_on": turn_airplane_mode(True), "turn_airplane_mode_off": turn_airplane_mode(False),
    "unseat_sim_card": unseat_sim_card, "lock_sim_card": lock_sim_card,
    "turn_data_on": _switch("data_enabled", True, search=False), "turn_data_off": _switch("data_enabled", False),
    "turn_roaming_on": _switch("roaming_enabled", True), "turn_roaming_off": _switch("roaming_enabled", False),
    "turn_data_saver_mode_on": _switch("data_saver_mode", True, search=False),
    "turn_data_saver_mode_off": _switch("data_saver_mode", False, search=False),
    "break_apn_settings": break_apn_settings, "break_apn_mms_setting": break_apn_mms_setting,
    "set_wifi_calling": set_wifi_calling, "break_vpn": break_vpn, "remove_app_permission": remove_app_permission,
}


def _overdue_cleared(db, overdue_bill_id):
    return db["bills"].get(overdue_bill_id, {"status": "Paid"})["status"] == "Paid"


def _speed_at_least(u, expected_speed, expected_desc=None):
    mbps, desc = _speed(u)
    return (mbps or 0.0) >= expected_speed and (expected_desc is None or desc.lower() == expected_desc.lower())


ASSERTIONS = {   # agent side (the records), then user side (the phone)
    "assert_data_refueling_amount": lambda db, customer_id, line_id, expected_amount:
        abs(_target_line(db, customer_id, line_id)["data_refueling_gb"] - expected_amount) < 1e-6,
    "assert_line_status": lambda db, customer_id, line_id, expected_status:
        _target_line(db, customer_id, line_id)["status"] == expected_status,
    "assert_overdue_bill_exists": lambda db, customer_id, overdue_bill_id:
        overdue_bill_id in get_customer_by_id(db, customer_id)["bill_ids"]
        and _find(db, "bills", overdue_bill_id, "Bill")["status"] == "Overdue",
    "assert_no_overdue_bill": _overdue_cleared,
    "assert_airplane_mode_status": lambda u, expected_status: u["device"]["airplane_mode"] == expected_status,
    "assert_service_status": lambda u, expected_status: u["device"]["network_connection_status"] == expected_status,
    "assert_mobile_data_status": lambda u, expected_status: _data_works(u) == expected_status,
    "assert_mobile_roaming_status": lambda u, expected_status: u["device"]["roaming_enabled"] == expected_status,
    "assert_mobile_data_saver_mode_status": lambda u, expected_status: u["device"]["data_saver_mode"] == expected_status,
    "assert_internet_speed": _speed_at_least,
    "assert_internet_not_excellent": lambda u: _speed(u)[1].lower() != "excellent",
    "assert_can_send_mms": lambda u, expected_status: _mms_works(u) == expected_status,
    "assert_mobile_data_usage_exceeded": lambda u, expected_status:
        u["surroundings"]["mobile_data_usage_exceeded"] == expected_status,
}


def sync(db, u):
    """tau2's TelecomEnvironment.sync_tools, run after every call: the user's line (found by the phone's number)
    decides whether the phone may roam and whether its line is active and its data allowance used up; a payment the
    user made marks its bill paid; the first bill awaiting payment becomes the phone's payment request."""
    s = u.get("surroundings") or {}
    if not db or s.get("phone_number") is None:
        return
    line = _line_by_phone(db, s["phone_number"])
    plan = _find(db, "plans", line["plan_id"], "Plan")
    s.update(line_active=line["status"] == "Active", roaming_allowed=bool(line["roaming_enabled"]),
             mobile_data_usage_exceeded=line["data_used_gb"] >= plan["data_limit_gb"] + line["data_refueling_gb"])
    if s["payment_request"] is not None and s["payment_request"].get("paid"):
        _find(db, "bills", s["payment_request"]["bill_id"], "Bill")["status"] = "Paid"
        s["payment_request"] = None
    if s["payment_request"] is None:
        waiting = _awaiting(db, get_customer_by_phone(db, s["phone_number"]))
        if waiting:
            s["payment_request"] = {"bill_id": waiting[0]["bill_id"], "amount_due": waiting[0]["total_due"], "paid": False}


S, N, B, OBJ = {"type": "string"}, {"type": "number"}, {"type": "integer"}, {"type": "object"}
CL = {"customer_id": S, "line_id": S}
TOOLS = [
    (get_customer_by_phone, "Find a customer by their primary contact or line phone number.", {"phone_number": S}),
    (get_customer_by_id, "Get a customer by their customer id.", {"customer_id": S}),
    (get_customer_by_name, "Find customers by full name and date of birth (YYYY-MM-DD).", {"full_name": S, "dob": S}),
    (get_details_by_id, "Get the record with this id: a customer (C...), line (L...), device (D...), bill (B...) or "
                        "plan (P...).", {"id": S}),
    (suspend_line, "Suspend an active line (at most 6 months; $5/month holding fee).", {**CL, "reason": S}),
    (resume_line, "Resume a suspended line.", CL),
    (get_bills_for_customer, "A customer's bills, newest first.", {"customer_id": S, "limit": B}, ["customer_id"]),
    (send_payment_request, "Send the customer a payment request for one of their bills (none may already be awaiting "
                           "payment; check the bill's status first).", {"customer_id": S, "bill_id": S}),
    (get_data_usage, "A line's data used this cycle, its plan's limit, data refueled and the cycle's end.", CL),
    (enable_roaming, "Enable international roaming on a line.", CL),
    (disable_roaming, "Disable international roaming on a line.", CL),
    (transfer_to_human_agents, "Transfer the user to a human agent, with a summary; only if they ask for one, or "
                               "the policy and tools cannot solve the issue.", {"summary": S}),
    (refuel_data, "Add data (GB) to an active line, charged on the customer's next bill at the plan's rate.",
     {**CL, "gb_amount": N}),
]
USER_TOOLS = [
    (check_status_bar, "What the phone's status bar shows: signal, network type, mobile data, Wi-Fi, VPN, battery.", {}),
    (check_network_status, "The phone's connection status: airplane mode, SIM, cellular connection, signal, network "
                           "type, mobile data, data roaming, Wi-Fi.", {}),
    (check_network_mode_preference, "The phone's preferred network mode.", {}),
    (set_network_mode_preference, "Set the preferred network mode: 4g_5g_preferred, 4g_only, 3g_only or 2g_only.",
     {"mode": S}),
    (run_speed_test, "Measure the phone's mobile data download speed.", {}),
    (toggle_airplane_mode, "Turn airplane mode on or off.", {}),
    (check_sim_status, "Whether the SIM card is active, missing or locked.", {}),
    (reseat_sim_card, "Take the SIM card out and put it back in.", {}),
    (toggle_data, "Turn mobile data on or off.", {}),
    (toggle_roaming, "Turn data roaming on or off.", {}),
    (check_data_restriction_status, "Whether data saver mode is on.", {}),
    (toggle_data_saver_mode, "Turn data saver mode on or off.", {}),
    (check_apn_settings, "The phone's APN settings (the name and the MMS server URL).", {}),
    (set_apn_settings, "Set the APN settings (fields apn_name, reset_at_reboot, mms_apn, mmsc_url, mms_proxy, "
                       "mms_port).", {"apn_settings": OBJ}),
    (reset_apn_settings, "Reset the APN settings to the defaults at the next reboot.", {}),
    (check_wifi_status, "Whether Wi-Fi is on and connected, and its signal.", {}),
    (toggle_wifi, "Turn Wi-Fi on or off.", {}),
    (check_wifi_calling_status, "Whether Wi-Fi calling is on.", {}),
    (toggle_wifi_calling, "Turn Wi-Fi calling on or off.", {}),
    (check_vpn_status, "Whether a VPN is on and connected, with its details.", {}),
    (connect_vpn, "Connect the VPN.", {}),
    (disconnect_vpn, "Disconnect the VPN.", {}),
    (check_installed_apps, "The apps installed on the phone.", {}),
    (check_app_status, "An app's status and permissions.", {"app_name": S}),
    (check_app_permissions, "An app's permissions.", {"app_name": S}),
    (grant_app_permission, "Grant an app a permission (sms, storage, phone or network).", {"app_name": S, "permission": S}),
    (can_send_mms, "Whether the messaging app can send MMS messages.", {}),
    (reboot_device, "Restart the phone.", {}),
    (check_payment_request, "Whether the agent has sent a payment request.", {}),
    (make_payment, "Pay the bill of the agent's payment request.", {}),
]
WRITES = {"suspend_line", "resume_line", "send_payment_request", "enable_roaming", "disable_roaming", "refuel_data"}
