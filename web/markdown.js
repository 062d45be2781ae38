// Assistant replies rendered as Markdown, safely: markdown-it (vendored,
// pinned: vendor/markdown-it.esm.min.mjs is markdown-it 15.0.3's own
// browser build, unmodified) with raw HTML disabled, so anything the agent
// writes as HTML is shown as text; markdown-it's link check refuses
// javascript:, vbscript:, file: and data: (but images) links; and the
// page's CSP (no inline script, images from this origin only) stands
// behind both.

import markdownit from './vendor/markdown-it.esm.min.mjs';

const md = markdownit({ html: false, linkify: true, typographer: false });

// Links open elsewhere, with no handle on this page and no referrer.
const linkOpen = md.renderer.rules.link_open || ((tokens, idx, options, env, self) => self.renderToken(tokens, idx, options));
md.renderer.rules.link_open = (tokens, idx, options, env, self) => {
  tokens[idx].attrSet('target', '_blank');
  tokens[idx].attrSet('rel', 'noopener noreferrer nofollow');
  return linkOpen(tokens, idx, options, env, self);
};

// Table cell alignment is an inline style, which the CSP refuses: use a
// class instead.
for (const rule of ['th_open', 'td_open']) {
  md.renderer.rules[rule] = (tokens, idx, options, env, self) => {
    const token = tokens[idx];
    const style = token.attrGet('style');
    if (style) {
      token.attrs = token.attrs.filter(([name]) => name !== 'style');
      const align = /text-align:(\w+)/.exec(style);
      if (align) token.attrJoin('class', `align-${align[1]}`);
    }
    return self.renderToken(tokens, idx, options);
  };
}

export function renderMarkdown(node, text) {
  node.innerHTML = md.render(text);
}
