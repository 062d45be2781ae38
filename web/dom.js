// What the page's scripts share: the stored token and two DOM helpers.

export const TOKEN_KEY = 'linger.token';

export const $ = (id) => document.getElementById(id);

export function h(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}
