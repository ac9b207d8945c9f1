"""Chat template goldens: transformers' rendering of our chat_template.jinja.

Writes tests/golden/chat_template.json. Run from the repository root:

    cargo run -p xtask -- tokenizer /tmp/qwen35_tok      # tokenizer files + chat_template.jinja
    /work/pyenv/bin/python tests/generators/chat_template_goldens.py /tmp/qwen35_tok

Each case is rendered with ``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
tools=..., add_generation_prompt=..., tokenize=False, **kwargs)``. Tool-call ``arguments`` given as
a JSON string (OpenAI form) are first parsed with ``json.loads``, as ``transformers serve`` does
before rendering (plain ``apply_chat_template`` cannot iterate a string with ``|items``); the
golden keeps the string form as input, so the Rust side must do the same parsing. Error cases
record transformers' exception message (``raise_exception`` → ``TemplateError``, source
"template"); an empty conversation is refused by transformers itself before rendering (source
"transformers"; the template would raise "No messages provided.").
"""

import copy
import json
import os
import sys

import jinja2
import transformers
from transformers import AutoTokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city (°C).",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 東京"},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
    },
}

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c, **kw: {"role": "assistant", "content": c, **kw}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731
T = lambda c: {"role": "tool", "content": c}  # noqa: E731


def call(name, args):
    return {"id": "call_" + name, "type": "function", "function": {"name": name, "arguments": args}}


CASES = [
    ("single_user_gen", [U("Hi")], None, True, {}),
    ("single_user_no_think", [U("Hi")], None, True, {"enable_thinking": False}),
    ("single_user_think_true", [U("Hi")], None, True, {"enable_thinking": True}),
    ("no_generation_prompt", [U("Hi"), A("Hello!")], None, False, {}),
    ("system_user", [S("  You are a helpful assistant.\n"), U("  What is 2+2?  ")], None, True, {}),
    (
        "multi_turn_reasoning_content",
        [
            S("Be brief."),
            U("What is 2+2?"),
            A("4", reasoning_content="Simple arithmetic: 2+2=4."),
            U("And 3+3?"),
            A("6", reasoning_content="\nAgain simple.\n"),
        ],
        None,
        False,
        {},
    ),
    (
        "think_inside_content",
        [U("Q1"), A("<think>\nold reasoning\n</think>\n\nold answer"), U("Q2"), A("<think>new reasoning</think>new answer")],
        None,
        True,
        {"enable_thinking": False},
    ),
    (
        "tools_dict_args",
        [
            S("You can check weather."),
            U("Weather in Paris and Tokyo for 3 days?"),
            A(
                "Let me check.",
                tool_calls=[call("get_weather", {"city": "Paris", "days": 3}), call("get_weather", {"city": "東京", "days": 3})],
            ),
            T('{"temp": 21, "sky": "clear"}'),
            T('{"temp": 18, "sky": "rain"}'),
        ],
        [WEATHER_TOOL],
        True,
        {},
    ),
    (
        "tools_string_args",
        [
            U("Search for rust tokenizers"),
            A(
                "",
                tool_calls=[
                    call("search", '{"query": "rust tokenizers", "filters": {"lang": "en", "year": 2025}, "flag": true, "none": null, "n": 1.5}')
                ],
            ),
            T("result: tokenizers crate"),
            A("Found it: the tokenizers crate."),
            U("Thanks"),
        ],
        [WEATHER_TOOL, SEARCH_TOOL],
        True,
        {"enable_thinking": True},
    ),
    (
        "tools_no_system",
        [U("Weather?"), A(None, tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "Rome", "tags": ["a", "b"]}}}])],
        [WEATHER_TOOL],
        False,
        {},
    ),
    (
        "content_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "System in parts."}]},
            {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
        ],
        None,
        True,
        {},
    ),
    (
        "multi_step_tool_last_query",
        [
            U("Do the thing"),
            A("", reasoning_content="need a tool", tool_calls=[call("search", {"query": "thing"})]),
            T("<b>thing</b> done"),
            A("Done.", reasoning_content="tool finished"),
        ],
        [SEARCH_TOOL],
        False,
        {},
    ),
    (
        "unicode_and_whitespace",
        [S(""), U("\t  Привет 🦀 你好  \n\n"), A("  Ответ  ")],
        None,
        True,
        {"enable_thinking": False},
    ),
    ("tool_response_user_message", [U("real question"), U("<tool_response>\nx\n</tool_response>")], None, True, {}),
]

ERROR_CASES = [
    ("err_no_messages", [], None, True, {}),
    ("err_system_not_first", [U("Hi"), S("late system")], None, True, {}),
    ("err_unknown_role", [U("Hi"), {"role": "robot", "content": "beep"}], None, True, {}),
    ("err_no_user_query", [S("sys"), A("hi")], None, True, {}),
    ("err_image_in_system", [{"role": "system", "content": [{"type": "image", "image": "x.png"}]}, U("Hi")], None, True, {}),
]


def parse_string_arguments(messages):
    """What `transformers serve` does before rendering: json.loads string tool-call arguments."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or tc
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    return messages


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    out = []
    for name, messages, tools, agp, kwargs in CASES:
        text = tok.apply_chat_template(
            parse_string_arguments(messages), tools=tools, add_generation_prompt=agp, tokenize=False, **kwargs
        )
        out.append({"name": name, "messages": messages, "tools": tools, "add_generation_prompt": agp, "kwargs": kwargs, "expected": text})
    for name, messages, tools, agp, kwargs in ERROR_CASES:
        try:
            tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            err, source = str(e), "template"
        except ValueError as e:  # transformers rejects an empty conversation before rendering
            err, source = str(e), "transformers"
        else:
            raise SystemExit(f"{name}: expected an error")
        out.append(
            {"name": name, "messages": messages, "tools": tools, "add_generation_prompt": agp, "kwargs": kwargs, "error": err, "error_source": source}
        )
    doc = {
        "generator": "tests/generators/chat_template_goldens.py",
        "versions": {"transformers": transformers.__version__, "jinja2": jinja2.__version__, "python": sys.version.split()[0]},
        "cases": out,
    }
    path = os.path.join(os.path.dirname(__file__), "..", "golden", "chat_template.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(out)} cases -> {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
