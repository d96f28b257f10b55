"""tau3's telecom domain at full scale (envs/tau_telecom.py, run by envs/ecommerce.py's EcommerceEnv): the phone's
rules, the two sides kept in sync, whole episodes with an LLM user (a fake one) that works the phone with its own
tools, and bad data stopping with one line. The fixture is written here, in tau2's file formats (not tau3's files)."""
import json
import os
import tomllib

import pytest
from test_env_ecommerce import FakeUser, _play

from envs import tau_telecom as tel
from envs.base import UsageError, tool_call_text
from envs.ecommerce import EcommerceEnv
from envs.tau_store import ASSERTIONS, SCHEMAS, run_tool

DB_TOML = """
[[plans]]
plan_id = "P1"
name = "Basic"
data_limit_gb = 5.0
price_per_month = 40.0
data_refueling_price_per_gb = 5.0

[[devices]]
device_id = "D1"
device_type = "phone"
model = "X"
is_esim_capable = true
activated = true
activation_date = 2025-01-20T14:30:00

[[lines]]
line_id = "L1"
phone_number = "555-0001"
status = "Active"
plan_id = "P1"
device_id = "D1"
data_used_gb = 1.0
data_refueling_gb = 0.0
roaming_enabled = false

[[customers]]
customer_id = "C1"
full_name = "Ann Lee"
date_of_birth = "1990-01-01"
phone_number = "555-0001"
line_ids = ["L1"]
bill_ids = ["B1"]

[[bills]]
bill_id = "B1"
customer_id = "C1"
period_start = 2025-01-01
period_end = 2025-01-31
issue_date = 2025-01-05
due_date = 2025-01-19
total_due = 40.0
status = "Paid"
line_items = []
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DB_TOML = '[device]\nbattery_level = 60\n\n[device.active_apn_settings]\napn_name = "internet"\n'
ME = {"env_type": "user", "func_name": "set_user_info", "arguments": {"name": "Ann Lee", "phone_number": "555-0001"}}
CL = {"customer_id": "C1", "line_id": "L1"}


def _assert(env_type, name, **arguments):
    return {"env_type": env_type, "func_name": name, "arguments": arguments, "assert_value": True}


TASKS = [
    {"id": "abroad", "user_scenario": {"instructions": {"reason_for_call": "No data abroad.", "known_info": "Ann Lee"}},
     "initial_state": {"initialization_actions": [
         ME, {"env_type": "user", "func_name": "set_user_location", "arguments": {"abroad": True}},
         {"env_type": "user", "func_name": "turn_roaming_off", "arguments": {}}]},
     "evaluation_criteria": {"actions": [{"name": "enable_roaming", "arguments": CL},
                                         {"requestor": "user", "name": "toggle_roaming", "arguments": {}}],
                             "env_assertions": [_assert("user", "assert_mobile_data_status", expected_status=True)],
                             "reward_basis": ["ENV_ASSERTION"]}},
    {"id": "overdue", "user_scenario": {"instructions": "No service."},
     "initial_state": {"initialization_actions": [
         ME, {"env_type": "assistant", "func_name": "suspend_line_for_overdue_bill",
              "arguments": dict(CL, new_bill_id="B9", contract_ended=False)},
         {"env_type": "user", "func_name": "simulate_network_search", "arguments": {}}]},   # the phone sees it
     "evaluation_criteria": {"env_assertions": [_assert("assistant", "assert_no_overdue_bill", overdue_bill_id="B9"),
                                                _assert("user", "assert_service_status", expected_status="connected")],
                             "reward_basis": ["ENV_ASSERTION"]}},
    {"id": "used_up", "user_scenario": {"instructions": "Slow data; refuel 2 GB if needed."},
     "initial_state": {"initialization_actions": [
         ME, {"env_type": "assistant", "func_name": "set_data_usage", "arguments": dict(CL, data_used_gb=5.5)}]},
     "evaluation_criteria": {"env_assertions": [
         _assert("assistant", "assert_data_refueling_amount", expected_amount=2.0, **CL),
         _assert("user", "assert_internet_speed", expected_speed=200, expected_desc="excellent")],
         "reward_basis": ["ENV_ASSERTION"]}},
    {"id": "locked", "user_scenario": {"instructions": "No service."},
     "initial_state": {"initialization_actions": [
         ME, {"env_type": "user", "func_name": "lock_sim_card", "arguments": {"mode": "pin"}}]},
     "evaluation_criteria": {"actions": [{"name": "transfer_to_human_agents", "arguments": {"summary": "x"},
                                          "compare_args": []}],
                             "env_assertions": [_assert("user", "assert_service_status", expected_status="no_service")],
                             "reward_basis": ["ENV_ASSERTION", "ACTION"]}},
]


def write_telecom(root, tasks=TASKS, db=DB_TOML):
    root.mkdir(exist_ok=True)
    (root / "db.toml").write_text(db)
    (root / "user_db.toml").write_text(USER_DB_TOML)
    (root / "tasks.json").write_text(json.dumps(tasks))
    (root / "split_tasks.json").write_text(json.dumps({"base": [t["id"] for t in tasks]}))
    (root / "main_policy.md").write_text("# Telecom policy")
    (root / "tech_support_manual.md").write_text("# Tech support: check the status bar first.")
    return str(root)


@pytest.fixture
def user():
    """A fake LLM user (an OpenAI-compatible server on 127.0.0.1); each _play gives it its replies."""
    server = FakeUser([])
    yield server
    server.close()


def _user_call(name, **arguments):
    """What the LLM user sends to call one of its phone tools (OpenAI tools format)."""
    return {"content": None, "tool_calls": [{"id": name, "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _phone(**device):
    u = tel.load_user_db({"device": device})
    u["surroundings"]["phone_number"] = "555-0001"
    return u


def test_the_phone_follows_tau2s_rules():
    u = _phone()
    tel.simulate_network_search(u)      # 4g_5g_preferred where 5G is excellent: 5G, (50 + 500) / 2 Mbps
    assert tel._speed(u) == (275.0, "Excellent") and tel._mms_works(u)
    assert "Excellent" in tel.check_status_bar(u) and "Battery 80%" in tel.check_status_bar(u)
    tel.toggle_data_saver_mode(u)
    assert tel._speed(u) == (55.0, "Good")            # data saver: x 0.2
    tel.toggle_data_saver_mode(u)
    tel.set_network_mode_preference(u, "2g_only")    # 2G, poor signal: (0.1 + 0.4) / 2 x 0.2; no MMS on 2G
    assert tel._speed(u) == (0.05, "Very Poor") and not tel._mms_works(u)
    assert "not a valid option" in tel.set_network_mode_preference(u, "6g")
    u["surroundings"]["signal_strength"]["5G"] = "none"
    tel.set_network_mode_preference(u, "4g_5g_preferred")   # no 5G here: 4G at a good signal
    assert u["device"]["network_technology_connected"] == "4G" and tel._speed(u) == (44.0, "Good")
    tel.connect_vpn(u)
    tel.toggle_airplane_mode(u)                           # airplane mode: no network, the VPN dropped
    assert not tel._data_works(u) and not u["device"]["vpn_connected"] and tel.run_speed_test(u).startswith("Speed test failed")
    tel.toggle_airplane_mode(u)
    assert tel._data_works(u)
    tel.INIT_ONLY["break_vpn"](u)                         # a poor VPN server: x 0.1
    assert tel._speed(u) == (4.4, "Poor")
    tel.INIT_ONLY["break_apn_settings"](u)                # a broken APN: no service until reset and reboot
    assert u["device"]["network_connection_status"] == "no_service"
    tel.reset_apn_settings(u)
    assert u["device"]["network_connection_status"] == "no_service"
    assert "Resetting APN settings" in tel.reboot_device(u) and u["device"]["network_connection_status"] == "connected"
    tel.INIT_ONLY["remove_app_permission"](u, "messaging", "storage")
    assert not tel._mms_works(u) and "storage" not in tel.check_app_permissions(u, "messaging")
    assert run_tool("tau_telecom_user", u, "grant_app_permission", {"app_name": "messaging", "permission": "Camera"}) \
        [0].startswith("Error: Permission 'Camera' not tracked")
    tel.grant_app_permission(u, "messaging", "storage")
    tel.disconnect_vpn(u)
    assert tel._mms_works(u)
    tel.set_wifi_calling(u, True, mms_over_wifi=True)     # MMS over Wi-Fi calling: the carrier does not support it
    assert not tel._mms_works(u)
    assert run_tool("tau_telecom_user", u, "set_apn_settings", {"apn_settings": {"apn_name": "fast"}})[0].startswith("Error")


def test_sync_carries_the_records_to_the_phone_and_payments_back():
    db = tel.load_db(tomllib.loads(DB_TOML))
    assert db["devices"]["D1"]["activation_date"] == "2025-01-20T14:30:00"   # TOML dates become ISO strings
    u = _phone()
    tel.sync(db, u)
    assert u["surroundings"]["line_active"] and not u["surroundings"]["mobile_data_usage_exceeded"]
    tel.set_data_usage(db, "C1", "L1", 5.0)
    tel.sync(db, u)
    assert u["surroundings"]["mobile_data_usage_exceeded"] and not tel._data_works(u)
    tel.refuel_data(db, "C1", "L1", 1.0)                 # charged on a new draft bill with a derived id
    tel.sync(db, u)
    assert tel._data_works(u)
    draft = [b for b in db["bills"].values() if b["status"] == "Draft"]
    assert len(draft) == 1 and draft[0]["total_due"] == 5.0 and draft[0]["period_start"] == "2025-03-01"
    assert draft[0]["period_end"] == "2025-03-31" and draft[0]["bill_id"] in db["customers"]["C1"]["bill_ids"]
    tel.suspend_line_for_overdue_bill(db, "C1", "L1", "B9", contract_ended=True)
    tel.sync(db, u)
    assert not u["surroundings"]["line_active"] and db["bills"]["B9"]["period_start"] == "2025-01-01"
    assert db["lines"]["L1"]["contract_end_date"] == "2025-01-31"
    assert tel.check_payment_request(u) == "No payment request has been made."
    with pytest.raises(tel.ToolError, match="Bill B7 not found"):
        tel.send_payment_request(db, "C1", "B7")
    tel.send_payment_request(db, "C1", "B9")
    tel.sync(db, u)                                       # the bill awaiting payment reaches the phone
    assert "bill B9 of 40.0 USD" in tel.check_payment_request(u)
    tel.make_payment(u)
    tel.sync(db, u)                                       # ... and the payment reaches the records
    assert db["bills"]["B9"]["status"] == "Paid" and u["surroundings"]["payment_request"] is None
    assert ASSERTIONS["assert_no_overdue_bill"](db, "B9")


def test_telecom_episodes_with_an_llm_user_working_the_phone(tmp_path, user):
    """Whole episodes: the agent's calls change the records, the user model's tool calls change the phone, the two
    are synced after every call, and the reward is tau2's ENV_ASSERTION (and ACTION) on the final state."""
    env = EcommerceEnv(data=write_telecom(tmp_path / "tel"), user_url=user.url, user_model="m")
    tasks = {t.gold["id"]: t for t in env.tasks("base")}
    assert env.world == "tau_telecom" and env.policy.startswith("<main_policy>\n# Telecom policy")
    assert "<tech_support_policy>" in env.policy and len(tasks) == 4 and env.max_turns == 100
    assert {s["function"]["name"] for s in tasks["abroad"].tools} >= {"get_customer_by_phone", "refuel_data"}
    stop = "###STOP###"
    # abroad with roaming off on the line and on the phone: both sides must switch it on
    enable = tool_call_text("enable_roaming", CL)
    state, r = _play(env, tasks["abroad"], [enable, "Please turn on data roaming on your phone.", "Great."],
                     ["My data does not work abroad.", _user_call("toggle_roaming"), "Roaming is on now.", stop], user)
    assert r == 1 and state.info["user_db"]["surroundings"]["roaming_allowed"]
    assert [t["function"]["name"] for t in user.requests[1]["body"]["tools"]] == [s["function"]["name"] for s in
                                                                                SCHEMAS["tau_telecom_user"]]
    assert "Data Roaming is now ON." in user.requests[2]["body"]["messages"][-1]["content"]   # the result it saw
    assert _play(env, tasks["abroad"], [enable, "Done."], ["No data abroad.", stop], user)[1] == 0   # phone still off
    # an overdue bill: the agent requests payment, the user pays on the phone, the agent resumes, the user reboots
    turns = [tool_call_text("send_payment_request", {"customer_id": "C1", "bill_id": "B9"}), "Please pay it.",
             tool_call_text("resume_line", CL), "Please restart your phone.", "Glad to help."]
    replies = ["I have no service.", _user_call("check_payment_request"), _user_call("make_payment"), "Paid.",
               _user_call("reboot_device"), "It works.", stop]
    state, r = _play(env, tasks["overdue"], turns, replies, user)
    assert r == 1 and state.info["db"]["lines"]["L1"]["status"] == "Active"
    state, r = _play(env, tasks["overdue"], turns[:2] + ["Bye."], replies[:4] + [stop], user)
    assert r == 0 and state.info["ended"] == "user_stop" and state.info["db"]["bills"]["B9"]["status"] == "Paid"
    # a used-up allowance: refuel 2 GB (any other amount fails the assertion on the records)
    refuel = tool_call_text("refuel_data", dict(CL, gb_amount=2.0))
    assert _play(env, tasks["used_up"], [refuel, "Refueled."], ["Slow data.", stop], user)[1] == 1
    assert _play(env, tasks["used_up"], [tool_call_text("refuel_data", dict(CL, gb_amount=1.0)), "Done."],
                 ["Slow data.", stop], user)[1] == 0
    # a PIN-locked SIM: nothing fixes it; the agent must transfer
    transfer = tool_call_text("transfer_to_human_agents", {"summary": "SIM locked"})
    assert _play(env, tasks["locked"], [transfer], ["No service."], user)[1] == 1
    assert _play(env, tasks["locked"], ["Try rebooting."], ["No service.", stop], user)[1] == 0


def test_telecom_bad_data_stops_with_one_line(tmp_path, user):
    with pytest.raises(UsageError, match="malformed TOML"):
        EcommerceEnv(data=write_telecom(tmp_path / "a", db="[[plans]\n"), user_url=user.url, user_model="m")
    with pytest.raises(UsageError, match="needs a list \\[\\[customers\\]\\]"):
        EcommerceEnv(data=write_telecom(tmp_path / "b", db=DB_TOML.replace("[[customers]]", "[[clients]]")),
                     user_url=user.url, user_model="m")
    (tmp_path / "a" / "db.toml").write_text(DB_TOML)
    (tmp_path / "a" / "tech_support_manual.md").unlink()
    with pytest.raises(UsageError, match="no tech_support_manual.md"):
        EcommerceEnv(data=str(tmp_path / "a"), user_url=user.url, user_model="m")
    unknown = [dict(TASKS[0], initial_state={"initialization_actions": [
        {"env_type": "user", "func_name": "melt_phone", "arguments": {}}]})]
    with pytest.raises(UsageError, match="unknown initialization call 'melt_phone'"):
        EcommerceEnv(data=write_telecom(tmp_path / "c", unknown), user_url=user.url, user_model="m").tasks("base")
    stranger = [dict(TASKS[0], initial_state={"initialization_actions": [
        dict(ME, arguments={"name": "X", "phone_number": "555-9999"})]})]
    env = EcommerceEnv(data=write_telecom(tmp_path / "d", stranger), user_url=user.url, user_model="m")
    with pytest.raises(UsageError, match="initial state of abroad fails at set_user_info: .*555-9999 not found"):
        env.reset(env.tasks("base")[0])


def test_the_gold_replay_check_of_a_telecom_directory(tmp_path):
    """python bench/tau_gold_replay.py DIR SPLIT: gold actions replayed and scored, and no action. In this fixture two tasks
    are solved by their gold actions (roaming switched on at both ends; the transfer); two have none (their gold is
    the assertions alone), and nothing solves no task."""
    import subprocess
    import sys
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from tau_gold_replay import gold_check
    assert gold_check(write_telecom(tmp_path / "t"), "base") == (4, 2.0, 0.0)
    r = subprocess.run([sys.executable, "bench/tau_gold_replay.py", str(tmp_path / "t"), "base"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "4 tasks: gold actions replayed solve 2, doing nothing solves 0"
    r = subprocess.run([sys.executable, "bench/tau_gold_replay.py", str(tmp_path / "none")], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("error: e-commerce data directory not found")
