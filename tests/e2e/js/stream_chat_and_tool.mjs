// The `openai` npm package against a Sluice server: a streamed chat and a streamed tool call.
// Usage: node stream_chat_and_tool.mjs BASE_URL MODEL OPENAI_PACKAGE_DIR. Prints one JSON line of what it
// saw; exits non-zero when a stream is malformed (the SDK throws) or an assertion fails.
import assert from "node:assert/strict";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [baseURL, model, packageDir] = process.argv.slice(2);
const { default: OpenAI } = await import(pathToFileURL(join(packageDir, "index.mjs")).href);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused" });

// 1) Text: the deltas add up to the non-streamed answer; the last chunk before usage says why it stopped.
const messages = [{ role: "user", content: "Reply with just the word yes." }];
const full = await client.chat.completions.create({ model, messages, max_tokens: 50, temperature: 0 });
const stream = await client.chat.completions.create({
  model, messages, max_tokens: 50, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let text = "";
const finishReasons = [];
let usage = null;
for await (const chunk of stream) {
  for (const choice of chunk.choices) {
    text += choice.delta.content ?? "";
    if (choice.finish_reason) finishReasons.push(choice.finish_reason);
  }
  if (chunk.usage) usage = chunk.usage;
}
assert.equal(text, full.choices[0].message.content);
assert.deepEqual(finishReasons, [full.choices[0].finish_reason]);
assert.equal(usage.completion_tokens, full.usage.completion_tokens);

// 2) A tool call through the SDK's stream helper, which assembles the call's argument deltas.
const runner = client.chat.completions.stream({
  model,
  messages: [{ role: "user", content: "What is the weather in Oslo?" }],
  tools: [{
    type: "function",
    function: {
      name: "get_weather",
      parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
    },
  }],
  tool_choice: "required",
  max_tokens: 40,
  temperature: 0,
});
let argumentDeltas = "";
runner.on("tool_calls.function.arguments.delta", (event) => { argumentDeltas += event.arguments_delta; });
const completion = await runner.finalChatCompletion();
const [call] = completion.choices[0].message.tool_calls;
assert.equal(completion.choices[0].finish_reason, "tool_calls");
assert.equal(call.function.name, "get_weather");
assert.equal(argumentDeltas, call.function.arguments);
assert.equal(typeof JSON.parse(call.function.arguments).city, "string");

console.log(JSON.stringify({ text, call: call.function }));
