// Package docs_test checks that the README and the pages under docs/ link
// only to files and headings that exist, so that moving or renaming a page
// or a section breaks the build rather than the reader's next click.
package docs_test

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// pages are the markdown files whose links are checked, relative to this
// directory.
func pages(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{filepath.Join("..", "README.md")}, docs...)
}

type link struct {
	line   int
	target string
}

type page struct {
	links   []link
	anchors map[string]bool
}

var (
	// inline links and images: [text](target) or [text](target "title")
	inlineLink = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeSpan   = regexp.MustCompile("`+[^`]*`+")
	heading    = regexp.MustCompile(`^(#{1,6})\s+(.*?)\s*#*\s*$`)
	linkInText = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
)

// parse reads a markdown file's links and the anchors its headings get,
// leaving out fenced code blocks and code spans, where brackets and hashes
// are not markdown.
func parse(data []byte) page {
	p := page{anchors: map[string]bool{}}
	seen := map[string]int{}
	fence := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimLeft(line, " ")
		if fence != "" {
			if strings.HasPrefix(trimmed, fence) {
				fence = ""
			}
			continue
		}
		if strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~") {
			fence = trimmed[:3]
			continue
		}
		if m := heading.FindStringSubmatch(line); m != nil {
			slug := slugify(m[2])
			if k := seen[slug]; k > 0 {
				p.anchors[fmt.Sprintf("%s-%d", slug, k)] = true
			} else {
				p.anchors[slug] = true
			}
			seen[slug]++
		}
		for _, m := range inlineLink.FindAllStringSubmatch(codeSpan.ReplaceAllString(line, "code"), -1) {
			p.links = append(p.links, link{line: n, target: m[1]})
		}
	}
	return p
}

// slugify gives a heading's anchor as GitHub does: the rendered text in
// lower case, spaces as hyphens, punctuation other than hyphens and
// underscores dropped.
func slugify(h string) string {
	h = linkInText.ReplaceAllString(h, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func external(target string) bool {
	for _, scheme := range []string{"http://", "https://", "mailto:"} {
		if strings.HasPrefix(target, scheme) {
			return true
		}
	}
	return false
}

func TestRelativeLinksResolve(t *testing.T) {
	parsed := map[string]page{}
	read := func(path string) (page, error) {
		if p, ok := parsed[path]; ok {
			return p, nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return page{}, err
		}
		p := parse(data)
		parsed[path] = p
		return p, nil
	}
	checked := 0
	for _, file := range pages(t) {
		p, err := read(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range p.links {
			if external(l.target) {
				continue
			}
			checked++
			path, frag, _ := strings.Cut(l.target, "#")
			target := file
			if path != "" {
				target = filepath.Join(filepath.Dir(file), filepath.FromSlash(path))
				if _, err := os.Stat(target); err != nil {
					t.Errorf("%s:%d: link to %s: no such file", file, l.line, l.target)
					continue
				}
			}
			if frag == "" || !strings.HasSuffix(target, ".md") {
				continue
			}
			tp, err := read(target)
			if err != nil {
				t.Errorf("%s:%d: link to %s: %v", file, l.line, l.target, err)
				continue
			}
			if !tp.anchors[frag] {
				t.Errorf("%s:%d: link to %s: %s has no heading with that anchor", file, l.line, l.target, target)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no relative link found: the parser reads nothing")
	}
}

func TestParseFindsLinksAndAnchors(t *testing.T) {
	md := "# Title\n" +
		"## What it costs: `/ui` and [Grafana](x.md)\n" +
		"## Title\n" +
		"See [a](a.md#b), ![img](img/ui.png \"shot\") and `[not](code.md)`.\n" +
		"```sh\n# not a heading [nor](link.md)\n```\n" +
		"[ext](https://example.com)\n"
	p := parse([]byte(md))
	var got []string
	for _, l := range p.links {
		got = append(got, l.target)
	}
	want := []string{"x.md", "a.md#b", "img/ui.png", "https://example.com"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("links: got %v, want %v", got, want)
	}
	for _, a := range []string{"title", "what-it-costs-ui-and-grafana", "title-1"} {
		if !p.anchors[a] {
			t.Errorf("anchor %q missing from %v", a, p.anchors)
		}
	}
	if p.anchors["not-a-heading-nor"] {
		t.Error("a comment in a code block became a heading")
	}
}
