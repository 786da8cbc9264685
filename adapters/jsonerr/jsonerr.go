// Package jsonerr words encoding/json's decoding errors in the terms of the
// request that failed to decode: "max_tokens must be an integer, got a
// string", not "cannot unmarshal string into Go struct field
// commonParams.max_tokens of type int". HTTP servers answer these to
// clients, who know the JSON they sent, not the Go types behind it.
package jsonerr

import (
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
)

// Describe explains err, returned by json.Unmarshal(data, target), for the
// client. prefix names the decoded value within the request ("nvext"), ""
// for the whole body.
func Describe(err error, target any, prefix string) string {
	whole := prefix
	if whole == "" {
		whole = "the body"
	}
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		path, t := resolve(reflect.TypeOf(target), te.Field)
		name := join(prefix, path)
		if name == "" {
			name = whole
		}
		want := kind(te.Type)
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) && t.Elem() == te.Type {
			want = "a list of " + plural(te.Type)
		}
		return name + " must be " + want + ", got " + got(te.Value)
	case errors.As(err, &se) && strings.Contains(se.Error(), "unexpected end"):
		return whole + " is not valid JSON (it ends early)"
	case errors.As(err, &se):
		return whole + " is not valid JSON (near byte " + strconv.FormatInt(se.Offset, 10) + ")"
	case err != nil:
		return whole + " could not be decoded: " + strings.TrimPrefix(err.Error(), "json: ")
	}
	return ""
}

// resolve follows the field path of an UnmarshalTypeError through t,
// dropping the names of embedded structs (which are not in the JSON), and
// returns the JSON path and the type found there.
func resolve(t reflect.Type, path string) (string, reflect.Type) {
	t = derefType(t)
	var out []string
	for seg := range strings.SplitSeq(path, ".") {
		if seg == "" {
			continue
		}
		ft, embedded := field(t, seg)
		if !embedded {
			out = append(out, seg)
		}
		t = ft
	}
	return strings.Join(out, "."), t
}

// field finds the struct field of t that seg names: a JSON name, or the Go
// name of an embedded struct.
func field(t reflect.Type, seg string) (reflect.Type, bool) {
	if t == nil || t.Kind() != reflect.Struct {
		return nil, false
	}
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Anonymous && f.Name == seg {
			return derefType(f.Type), true
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" {
			name = f.Name
		}
		if name == seg {
			return derefType(f.Type), false
		}
		if f.Anonymous {
			if ft, emb := field(derefType(f.Type), seg); ft != nil {
				return ft, emb
			}
		}
	}
	return nil, false
}

func derefType(t reflect.Type) reflect.Type {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

func join(prefix, path string) string {
	switch {
	case prefix == "":
		return path
	case path == "":
		return prefix
	}
	return prefix + "." + path
}

func kind(t reflect.Type) string {
	if t == nil {
		return "something else"
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Slice, reflect.Array:
		return "a list"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Pointer:
		return kind(t.Elem())
	}
	return "something else"
}

func plural(t reflect.Type) string {
	switch s := kind(t); {
	case strings.HasPrefix(s, "an integer"):
		return "integers"
	case strings.HasPrefix(s, "a non-negative integer"):
		return "non-negative integers"
	case s == "true or false":
		return "booleans"
	default:
		_, noun, _ := strings.Cut(s, " ")
		return noun + "s"
	}
}

// got words the Value of an UnmarshalTypeError ("string", "number -2").
func got(v string) string {
	switch v {
	case "string", "number":
		return "a " + v
	case "object":
		return "an object"
	case "array":
		return "a list"
	case "bool":
		return "true or false"
	}
	return v
}
