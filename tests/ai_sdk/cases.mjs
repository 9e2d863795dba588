// The Vercel AI SDK against the gateway: one case a run, its outcome as one JSON line.
//
//   node --input-type=module - CASE PROVIDER URL < cases.mjs    (run in .tools/ai-sdk)
//
// PROVIDER: "responses" (`openai(model)`, the Responses API, the SDK's default), "chat"
// (`openai.chat(model)`, chat completions) or "anthropic" (`anthropic(model)`, the
// Messages API). Read from stdin so that `ai`, `@ai-sdk/*` and `zod` resolve from the
// working directory, where `bash deploy/install-tools.sh` installed them
// (tests/test_ai_sdk.py runs it so). The model is the demo: it echoes the last
// message's words, calls each tool named in them, and answers a schema's minimal
// instance.
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import {
  generateObject,
  generateText,
  Output,
  stepCountIs,
  streamObject,
  streamText,
  tool,
} from "ai";
import { z } from "zod";

globalThis.AI_SDK_LOG_WARNINGS = false; // generateObject's deprecation, on stderr
const [, , name, provider, url] = process.argv;
const MODEL = "furnace-demo";

// every body the SDK sent, and the gateway's status for it
const sent = [];
async function recording(input, init) {
  const response = await fetch(input, init);
  sent.push({ path: new URL(input).pathname, status: response.status, body: JSON.parse(init.body) });
  return response;
}
const openai = createOpenAI({ baseURL: `${url}/v1`, apiKey: "unused", fetch: recording });
const anthropic = createAnthropic({ baseURL: `${url}/v1`, apiKey: "unused", fetch: recording });
const model = {
  responses: () => openai(MODEL),
  chat: () => openai.chat(MODEL),
  anthropic: () => anthropic(MODEL),
}[provider]();
// set: the Anthropic provider's default for a model it does not know (4,096) is more
// than a small context leaves
const maxOutputTokens = 256;

const executed = [];
const weather = tool({
  description: "The weather in a city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => {
    executed.push({ city });
    return { city, celsius: 20 };
  },
});
const person = z.object({ name: z.string(), age: z.number(), tags: z.array(z.string()) });

const steps = (result) =>
  result.steps.map((step) => ({
    finishReason: step.finishReason,
    text: step.text,
    toolCalls: step.toolCalls.map((call) => ({ toolName: call.toolName, input: call.input })),
    toolResults: step.toolResults.map((r) => ({ toolName: r.toolName, output: r.output })),
  }));
const tokens = (usage) => ({
  inputTokens: usage.inputTokens,
  outputTokens: usage.outputTokens,
  totalTokens: usage.totalTokens,
});

const cases = {
  async text() {
    const result = await generateText({ model, maxOutputTokens, prompt: "hello there" });
    return { text: result.text, finishReason: result.finishReason, usage: tokens(result.usage) };
  },

  async stream() {
    const result = streamText({ model, maxOutputTokens, prompt: "one two three" });
    const chunks = [];
    for await (const chunk of result.textStream) chunks.push(chunk);
    return {
      chunks,
      text: await result.text,
      finishReason: await result.finishReason,
      usage: tokens(await result.usage),
    };
  },

  // the model calls the tool, the SDK runs it and sends its result back: two steps
  async tools() {
    const result = await generateText({
      model,
      maxOutputTokens,
      tools: { weather },
      stopWhen: stepCountIs(3),
      prompt: "weather in Paris",
    });
    return { steps: steps(result), text: result.text, executed, usage: tokens(result.totalUsage) };
  },

  async streamTools() {
    const result = streamText({
      model,
      maxOutputTokens,
      tools: { weather },
      stopWhen: stepCountIs(3),
      prompt: "weather in Paris",
    });
    await result.consumeStream();
    return {
      steps: steps({ steps: await result.steps }),
      text: await result.text,
      executed,
      usage: tokens(await result.totalUsage),
    };
  },

  // a zod schema's object four ways: `Output.object` (generateText, streamText) and the
  // older generateObject and streamObject
  async object() {
    const generated = await generateText({
      model,
      maxOutputTokens,
      output: Output.object({ schema: person }),
      prompt: "a person",
    });
    const streamed = streamText({
      model,
      maxOutputTokens,
      output: Output.object({ schema: person }),
      prompt: "a person",
    });
    let partials = 0;
    for await (const _ of streamed.partialOutputStream) partials += 1;
    const object = await generateObject({ model, maxOutputTokens, schema: person, prompt: "a person" });
    const objects = streamObject({ model, maxOutputTokens, schema: person, prompt: "a person" });
    for await (const _ of objects.partialObjectStream);
    return {
      generateText: generated.output,
      streamText: await streamed.output,
      partials,
      generateObject: object.object,
      streamObject: await objects.object,
      usage: tokens(object.usage),
    };
  },

  // a reasoning model's agent loop, then a second turn after the first's messages: the
  // Responses provider sends an earlier step's reasoning and message back as
  // `item_reference`s (`store` is its default), the Messages provider its `thinking`
  // blocks with their signatures
  async reasoning() {
    const providerOptions = {
      openai: { forceReasoning: true, reasoningEffort: "low" },
      anthropic: { thinking: { type: "adaptive" }, effort: "low" },
    };
    const first = await generateText({
      model,
      maxOutputTokens,
      providerOptions,
      tools: { weather },
      stopWhen: stepCountIs(3),
      prompt: "weather in Paris",
    });
    const second = await generateText({
      model,
      maxOutputTokens,
      providerOptions,
      tools: { weather },
      messages: [
        { role: "user", content: "weather in Paris" },
        ...first.response.messages,
        { role: "user", content: "and tomorrow" },
      ],
    });
    return {
      steps: steps(first),
      reasoning: first.steps.map((step) => step.reasoningText ?? ""),
      text: first.text,
      second: { text: second.text, reasoning: second.reasoningText ?? "" },
      usage: tokens(first.totalUsage),
    };
  },

  // a conversation longer than the context, answered with its earlier turns dropped
  // (`providerOptions.openai.truncation`, the Responses provider's)
  async truncation() {
    const long = Array.from({ length: 2500 }, (_, i) => `w${i}`).join(" ");
    const result = await generateText({
      model,
      maxOutputTokens,
      providerOptions: { openai: { truncation: "auto" } },
      messages: [
        { role: "user", content: long },
        { role: "assistant", content: long },
        { role: "user", content: "and now" },
      ],
    });
    return {
      text: result.text,
      usage: tokens(result.usage),
      truncation: sent.map(({ body }) => body.truncation),
    };
  },

  // what this gateway refuses comes back as the gateway's 400, naming the parameter
  async refused() {
    const providerOptions = {
      openai: { textVerbosity: "low" },
      // the demo's workers take an effort, not a budget of thinking tokens
      anthropic: { thinking: { type: "enabled", budgetTokens: 1024 } },
    };
    try {
      // Anthropic's budget is at least 1,024 tokens, and less than `max_tokens`
      await generateText({ model, maxOutputTokens: 2048, providerOptions, prompt: "hello" });
      return { refused: false };
    } catch (error) {
      return {
        refused: true,
        statusCode: error.statusCode,
        message: error.message,
        retryable: error.isRetryable,
      };
    }
  },
};

const outcome = await cases[name]();
// the bodies' input item types (a Responses body's `input`), to see what was sent back
outcome.sent = sent.map(({ path, status, body }) => ({
  path,
  status,
  items: Array.isArray(body.input) ? body.input.map((item) => item.type ?? "message") : [],
}));
console.log(JSON.stringify(outcome));
