"""The official `openai` and `anthropic` Python SDKs against `ornith serve`'s HTTP API.

Run by tests/tests/http.rs (`official_python_sdks_against_the_server`) against an in-process
server over the scripted test runner, which replays the text after `SAY:` in the prompt, so every
answer below is known exactly. Usage: sdk_clients.py BASE_URL MODEL. Exit status 0: every check
passed; 3: the pinned SDKs are not installed (`pip install -r tests/requirements-sdk.txt`);
anything else: a check failed (the traceback says which).
"""

import json
import pathlib
import sys
import time

T0 = time.monotonic()


def mark(what):
    """Prints how long the checks took so far (the Rust test shows stdout)."""
    print(f"{time.monotonic() - T0:7.2f} s  {what}", flush=True)

REQUIREMENTS = pathlib.Path(__file__).resolve().parent.parent / "requirements-sdk.txt"


def pinned():
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


try:
    import anthropic
    import openai
except ImportError as e:
    print(f"sdk_clients.py: {e}; install the pinned SDKs: pip install -r {REQUIREMENTS}", file=sys.stderr)
    sys.exit(3)

for mod in (openai, anthropic):
    want = pinned()[mod.__name__]
    if mod.__version__ != want:
        print(
            f"sdk_clients.py: {mod.__name__} {mod.__version__} is installed, the tests pin {want}: "
            f"pip install -r {REQUIREMENTS}",
            file=sys.stderr,
        )
        sys.exit(3)

mark("imported the SDKs")
BASE, MODEL = sys.argv[1], sys.argv[2]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# Two tool calls after a thought, in the model's XML format (the scripted runner replays it).
TWO_CALLS = (
    "SAY:Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
WANT_ARGS = [{"city": "Paris", "days": 3}, {"city": "Oslo", "days": 1}]


def user(text):
    return [{"role": "user", "content": text}]


def check_openai():
    c = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == [MODEL]

    r = c.chat.completions.create(model=MODEL, messages=user("SAY:Hello, world!"), extra_body=NO_THINK)
    assert r.choices[0].message.content == "Hello, world!", r
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 14 and r.usage.total_tokens == r.usage.prompt_tokens + 14, r.usage

    mark('Streamed, usage once in the last chunk.')
    # Streamed, usage once in the last chunk.
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=user("SAY:Hello, world!"),
            extra_body=NO_THINK,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Hello, world!", text
    with_usage = [ch for ch in chunks if ch.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == [], chunks[-1]
    assert with_usage[0].usage.completion_tokens == 14

    mark('A stop string: not included, finish_reas')
    # A stop string: not included, finish_reason stop.
    r = c.chat.completions.create(model=MODEL, messages=user("SAY:one two three"), stop=[" three"], extra_body=NO_THINK)
    assert r.choices[0].message.content == "one two" and r.choices[0].finish_reason == "stop", r

    mark('Tools with required fields, non-streamed')
    # Tools with required fields, non-streamed and streamed; the thought in reasoning_content.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    r = c.chat.completions.create(model=MODEL, messages=user(TWO_CALLS), tools=tools)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert [json.loads(t.function.arguments) for t in m.tool_calls] == WANT_ARGS, m
    assert len({t.id for t in m.tool_calls}) == 2
    assert m.model_extra["reasoning_content"].strip() == "Checking.", m
    calls = {}
    for ch in c.chat.completions.create(model=MODEL, messages=user(TWO_CALLS), tools=tools, stream=True):
        for d in ch.choices[0].delta.tool_calls or []:
            e = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
            e["args"] += d.function.arguments or ""
    assert [json.loads(calls[i]["args"]) for i in sorted(calls)] == WANT_ARGS, calls
    assert all(calls[i]["name"] == "get_weather" and calls[i]["id"] for i in calls)

    mark('Completions.')
    # Completions.
    r = c.completions.create(model=MODEL, prompt="SAY:abcdef", max_tokens=3)
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "length", r

    mark('logprobs in the SDK types')
    # logprobs: parsed into the SDK's types (chat: ChoiceLogprobs; completions: Logprobs).
    r = c.chat.completions.create(model=MODEL, messages=user("SAY:hi"), logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    lp = r.choices[0].logprobs.content
    assert [e.token for e in lp] == ["h", "i", "<|im_end|>"] and lp[0].bytes == [104], lp
    assert abs(lp[0].logprob - (-0.104)) < 1e-6 and [t.token for t in lp[0].top_logprobs] == ["A", "B"], lp
    r = c.completions.create(model=MODEL, prompt="SAY:ab", logprobs=1)
    assert r.choices[0].logprobs.tokens == ["a", "b", "<|im_end|>"] and r.choices[0].logprobs.text_offset == [0, 1, 2], r
    assert r.choices[0].logprobs.top_logprobs[0] == {"A": -0.25, "a": -0.097}, r

    mark('n choices, seeded seed + i')
    # n choices: each its own sequence seeded seed + i (the scripted model says the seed's digit).
    r = c.chat.completions.create(model=MODEL, messages=user("SAY:c$S"), n=2, seed=10, extra_body=NO_THINK)
    assert [(ch.index, ch.message.content) for ch in r.choices] == [(0, "c0"), (1, "c1")], r
    r = c.completions.create(model=MODEL, prompt="SAY:d$S", n=3, seed=21)
    assert [ch.text for ch in r.choices] == ["d1", "d2", "d3"] and r.usage.completion_tokens == 9, r

    mark("Errors: the API's shape, raised as the S")
    # Errors: the API's shape, raised as the SDK's exceptions.
    try:
        c.chat.completions.create(model="other", messages=user("hi"))
        raise AssertionError("a wrong model must fail")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "model_not_found", e
    try:
        c.chat.completions.create(model=MODEL, messages=user("hi"), temperature=-1)
        raise AssertionError("a negative temperature must fail")
    except openai.BadRequestError as e:
        assert e.code == "invalid_request" and "temperature" in e.message, e

    mark('The Responses API: non-streamed, streame')
    # The Responses API: non-streamed, streamed through the SDK's accumulator, function calls.
    r = c.responses.create(model=MODEL, input="SAY:Hello, world!", reasoning={"effort": "none"})
    assert r.output_text == "Hello, world!" and r.status == "completed", r
    assert r.usage.output_tokens == 14
    rtools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}]
    mark('with c.responses.stream(')
    with c.responses.stream(model=MODEL, input=TWO_CALLS, tools=rtools) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.function_call_arguments.delta" in kinds, kinds
    fcs = [o for o in final.output if o.type == "function_call"]
    assert [json.loads(f.arguments) for f in fcs] == WANT_ARGS, final
    r = c.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": fcs[0].call_id, "name": "get_weather", "arguments": fcs[0].arguments},
            {"type": "function_call_output", "call_id": fcs[0].call_id, "output": "sunny"},
            {"role": "user", "content": "SAY:Good."},
        ],
        reasoning={"effort": "none"},
    )
    assert r.output_text == "Good.", r
    try:
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
        raise AssertionError("previous_response_id must fail")
    except openai.BadRequestError as e:
        assert "stateless" in e.message, e


def check_anthropic():
    c = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=60)
    off = {"type": "disabled"}
    r = c.messages.create(model=MODEL, max_tokens=64, messages=user("SAY:Hello, world!"), thinking=off)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Hello, world!", r
    assert r.stop_reason == "end_turn" and r.usage.output_tokens == 14, r

    mark('with c.messages.stream(model=MODEL, max_')
    with c.messages.stream(model=MODEL, max_tokens=64, messages=user("SAY:Hello, world!"), thinking=off) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Hello, world!" and final.usage.output_tokens == 14, final

    r = c.messages.create(
        model=MODEL, max_tokens=64, messages=user("SAY:one two three"), stop_sequences=["three"], thinking=off
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "three", r
    assert r.content[0].text == "one two ", r

    r = c.messages.create(model=MODEL, max_tokens=3, messages=user("SAY:abcdef"), thinking=off)
    assert r.stop_reason == "max_tokens" and r.content[0].text == "abc", r

    mark('tools = [{"name": "get_weather", "descri')
    tools = [{"name": "get_weather", "description": "Weather forecast", "input_schema": SCHEMA}]
    r = c.messages.create(model=MODEL, max_tokens=1024, messages=user(TWO_CALLS), tools=tools)
    assert r.stop_reason == "tool_use", r
    assert [b.type for b in r.content] == ["thinking", "tool_use", "tool_use"], r
    assert [b.input for b in r.content if b.type == "tool_use"] == WANT_ARGS, r
    with c.messages.stream(model=MODEL, max_tokens=1024, messages=user(TWO_CALLS), tools=tools) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == WANT_ARGS, final

    mark('count_tokens equals')
    # count_tokens equals the prompt the engine ran for the same body.
    body = {"model": MODEL, "system": "Be brief.", "messages": user("SAY:ok"), "tools": tools}
    counted = c.messages.count_tokens(**body).input_tokens
    ran = c.messages.create(max_tokens=4, **body).usage.input_tokens
    assert counted == ran and counted > 0, (counted, ran)

    try:
        c.messages.create(model="other", max_tokens=4, messages=user("hi"))
        raise AssertionError("a wrong model must fail")
    except anthropic.NotFoundError as e:
        assert e.status_code == 404, e
    try:
        c.messages.create(model=MODEL, max_tokens=4, messages=[])
        raise AssertionError("empty messages must fail")
    except anthropic.BadRequestError as e:
        assert e.status_code == 400, e


check_openai()
mark("openai done")
check_anthropic()
mark("anthropic done")
print(f"sdk_clients.py: openai {openai.__version__} and anthropic {anthropic.__version__}: every check passed")
